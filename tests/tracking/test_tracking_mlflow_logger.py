"""MLflow layout (experiment, study run, trial runs), batching, status mapping and outages,
against real ``mlflow server`` subprocesses; everything asserted through MlflowClient."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from hpsearch.errors import TrackingError
from hpsearch.tracking.mlflow_logger import (
    HISTORY_TAG,
    HTTP_POLICY,
    INCOMPLETE_TAG,
    OUTCOME_STATUS,
    SPOOL_SUFFIX,
    TrialTracker,
    apply_http_policy,
    backoff_delays,
    chunk_batch,
    claim_run_by_key,
    ensure_experiment,
    find_study_runs,
    is_gone,
    is_permanent_error,
    open_study_run,
    param_value,
    replay_spool,
    study_tags,
    terminal_status,
    terminal_tags,
    trial_params,
)
from hpsearch.tracking.server import LocalServer, free_port, start_local_server
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.exceptions import MlflowException, RestException
from tracking_helpers import CountingClient

EPOCH = {
    "train_loss": 1.0,
    "train_acc": 0.5,
    "val_loss": 1.1,
    "val_acc": 0.45,
    "lr": 0.1,
    "epoch_seconds": 2.0,
    "images_per_second": 1000.0,
}


def epoch_metrics(e: int) -> dict[str, float]:
    return {k: v + e / 100 for k, v in EPOCH.items()}


# --------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize(
    ("outcome", "status"),
    [
        ("completed", "FINISHED"),
        ("early_stopped", "FINISHED"),
        ("time_limit", "FINISHED"),
        ("pruned", "KILLED"),
        ("interrupted", "KILLED"),
        ("failed", "FAILED"),
        ("diverged", "KILLED"),
        ("out_of_memory", "KILLED"),
    ],
)
def test_terminal_status(outcome: str, status: str) -> None:
    assert terminal_status(outcome) == status


def test_terminal_status_unknown() -> None:
    with pytest.raises(ValueError, match="unknown trial outcome 'exploded'"):
        terminal_status("exploded")


def test_terminal_tags() -> None:
    assert terminal_tags("completed") == {"hpsearch.outcome": "completed"}
    assert terminal_tags("pruned", pruned_at_epoch=3) == {
        "hpsearch.outcome": "pruned",
        "hpsearch.pruned_at_epoch": "3",
    }
    assert terminal_tags("diverged")["hpsearch.reason"] == "diverged"
    assert terminal_tags("failed", reason="CUDA error")["hpsearch.reason"] == "CUDA error"
    assert terminal_tags("time_limit", reason="budget")["hpsearch.reason"] == "budget"
    assert len(terminal_tags("failed", reason="x" * 10000)["hpsearch.reason"]) == 8000


def test_chunk_batch_respects_mlflow_limits() -> None:
    m = [Metric(f"m{i}", 1.0, 0, 0) for i in range(2500)]
    p = [Param(f"p{i}", "v") for i in range(150)]
    t = [RunTag(f"t{i}", "v") for i in range(30)]
    chunks = chunk_batch(m, p, t)
    for cm, cp, ct in chunks:
        assert len(cm) <= 1000 and len(cp) <= 100 and len(ct) <= 100
        assert len(cm) + len(cp) + len(ct) <= 1000
    assert sum(len(c[0]) for c in chunks) == 2500
    assert sum(len(c[1]) for c in chunks) == 150
    assert sum(len(c[2]) for c in chunks) == 30
    assert len(chunks) == 3
    assert chunk_batch(m[:7], [], []) == [(m[:7], [], [])]  # one epoch = one request
    assert chunk_batch([], [], []) == [([], [], [])]


def test_is_permanent_error() -> None:
    assert is_permanent_error(MlflowException.invalid_parameter_value("bad"))
    assert is_permanent_error(
        RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no run"})
    )
    assert not is_permanent_error(MlflowException("down"))  # INTERNAL_ERROR -> 500
    assert not is_permanent_error(ConnectionError("refused"))
    # A 404 page that is not MLflow's JSON (a proxy's while MLflow behind it is down):
    # MLflow's client names it ENDPOINT_NOT_FOUND. Retried; a run MLflow says is gone is not.
    assert not is_permanent_error(_proxy_404())
    assert is_gone(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "x"}))
    assert not is_gone(_proxy_404())


def _proxy_404() -> MlflowException:
    from mlflow.protos.databricks_pb2 import ENDPOINT_NOT_FOUND

    error = MlflowException("404 != 200. Response body: '<html>'", error_code=ENDPOINT_NOT_FOUND)
    assert error.get_http_status_code() == 404
    return error


def test_backoff_delays() -> None:
    it = backoff_delays(0.5, 2.0, 4.0)
    assert [next(it) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_apply_http_policy_keeps_user_values() -> None:
    env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "9"}
    apply_http_policy(env)
    assert env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "9"
    assert env["MLFLOW_HTTP_REQUEST_TIMEOUT"] == HTTP_POLICY["MLFLOW_HTTP_REQUEST_TIMEOUT"]


def test_trial_params_and_param_value() -> None:
    params = trial_params(
        {"lr": 0.1, "batch_size": 64, "optimizer": "sgd", "image_size": None},
        dataset="cifar10",
        arch="resnet18",
        image_size=32,
    )
    assert params == {
        "lr": "0.1",
        "batch_size": "64",
        "optimizer": "sgd",
        "dataset": "cifar10",
        "arch": "resnet18",
        "image_size": "32",
    }
    assert param_value(1 / 3) == repr(1 / 3)
    assert len(param_value("x" * 7000)) == 6000


def test_study_tags_redacts_storage() -> None:
    tags = study_tags("tpe", "median", "postgresql://u:pw@db/optuna")
    assert tags["hpsearch.storage"] == "postgresql://u:***@db/optuna"
    assert tags["hpsearch.sampler"] == "tpe" and tags["hpsearch.pruner"] == "median"
    assert tags["hpsearch.version"]


# --------------------------------------------------------------------------- study level


@pytest.mark.slow
def test_ensure_experiment_and_study_run_reused(client: CountingClient, tmp_path: Path) -> None:
    exp = ensure_experiment(client, "study-a")
    assert ensure_experiment(client, "study-a") == exp
    experiment = client.get_experiment(exp)
    assert experiment.name == "study-a"
    # A training experiment: MLflow's UI opened it on its GenAI traces view (QA); one made
    # before the tag takes it too, and a kind a user set is kept.
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    old = client.create_experiment("study-old")
    mine = client.create_experiment("study-mine", tags={"mlflow.experimentKind": "finetuning"})
    assert ensure_experiment(client, "study-old") == old
    assert ensure_experiment(client, "study-mine") == mine
    kinds = [client.get_experiment(e).tags["mlflow.experimentKind"] for e in (old, mine)]
    assert kinds == ["custom_model_development", "finetuning"]
    tags = {
        "hpsearch.sampler": "tpe",
        "hpsearch.pruner": "asha",
        "hpsearch.storage": "postgresql://optuna:hunter2@db:5432/optuna",
    }
    run_id = open_study_run(client, exp, "study-a", tags, "study: a\nlr: 0.1\n")
    run = client.get_run(run_id)
    assert run.data.tags["hpsearch.role"] == "study"
    assert run.data.tags["hpsearch.storage"] == "postgresql://optuna:***@db:5432/optuna"
    assert "hunter2" not in str(run.data.tags)
    assert run.data.tags["hpsearch.sampler"] == "tpe"
    assert run.data.tags["hpsearch.version"]
    assert run.info.run_name == "study-a"
    yaml_path = client.download_artifacts(run_id, "study.yaml", str(tmp_path))
    assert Path(yaml_path).read_text() == "study: a\nlr: 0.1\n"

    client.set_terminated(run_id, "FINISHED")
    again = open_study_run(client, exp, "study-a", {**tags, "hpsearch.sampler": "gp"}, "v2\n")
    assert again == run_id
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"
    assert run.data.tags["hpsearch.sampler"] == "gp"
    assert find_study_runs(client, exp) == [run_id]

    # QA: another Optuna study of this name (another storage's, or this one deleted and
    # made again) had its trials' runs put under this study run. Each study (its uid) has
    # its own. The run an earlier version made, with no uid, is taken by the study that
    # version ran (`adopt_legacy`), never by a new one (review: it took another's).
    new = open_study_run(client, exp, "study-a", tags, "v1\n", uid="u0")
    assert new != run_id and "hpsearch.study_uid" not in client.get_run(run_id).data.tags
    first = open_study_run(client, exp, "study-a", tags, "v3\n", uid="u1", adopt_legacy=True)
    assert first == run_id and client.get_run(run_id).data.tags["hpsearch.study_uid"] == "u1"
    other = open_study_run(client, exp, "study-a", tags, "v1\n", uid="u2", adopt_legacy=True)
    assert other != run_id and client.get_run(other).data.tags["hpsearch.study_uid"] == "u2"
    assert find_study_runs(client, exp, "u1") == [run_id]
    assert find_study_runs(client, exp, "u2") == [other]
    assert find_study_runs(client, exp, "u3") == []
    assert find_study_runs(client, exp, "u0") == [new]
    # Asked of the server: past MLflow's page of 50 study runs, a study finds its own.
    for i in range(50):
        open_study_run(client, exp, "study-a", tags, "", uid=f"many{i}")
    late = open_study_run(client, exp, "study-a", tags, "", uid="late")
    assert find_study_runs(client, exp, "late") == [late]
    assert open_study_run(client, exp, "study-a", tags, "", uid="late") == late
    assert open_study_run(client, exp, "study-a", tags, "v1\n", uid="u2") == other


def test_study_level_errors_are_tracking_errors() -> None:
    dead = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    with pytest.raises(TrackingError, match="MLflow: cannot get or create experiment"):
        ensure_experiment(dead, "x")
    assert time.monotonic() - t0 < 30


# --------------------------------------------------------------------------- trial level


def make_tracker(
    client: MlflowClient, exp: str, parent: str, number: int, **kw: object
) -> TrialTracker:
    return TrialTracker(
        client,
        exp,
        parent,
        trial_number=number,
        study_name="s",
        params=trial_params({"lr": 0.1, "batch_size": 32}, arch="resnet18"),
        worker="w0",
        host="node1",
        gpu="0",
        **kw,
    )


def test_gpu_samples_go_out_on_their_own_during_a_long_epoch(
    client: CountingClient, experiment_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Samples waited for the next epoch's request: an epoch of an hour showed no GPU chart
    for an hour (and past 50,000 metrics the oldest were dropped with a healthy server)."""
    import hpsearch.tracking.mlflow_logger as ml

    parent = open_study_run(client, experiment_id, "s", {}, "x: 1\n")
    monkeypatch.setattr(ml, "SYSTEM_FLUSH_S", 0.0)
    tracker = make_tracker(client, experiment_id, parent, 8)
    assert tracker.flush(10)  # its params
    tracker.log_system({"system/gpu_utilization": 80.0})
    assert tracker.flush(10)
    assert tracker.run_id is not None
    history = client.get_metric_history(tracker.run_id, "system/gpu_utilization")
    assert [m.value for m in history] == [80.0]  # sent with no epoch logged
    tracker.finish("completed")


@pytest.mark.slow
def test_trial_run_layout_metrics_and_batching(
    client: CountingClient, experiment_id: str, tmp_path: Path
) -> None:
    parent = open_study_run(client, experiment_id, "s", {}, "x: 1\n")
    client.batches.clear()
    tracker = make_tracker(client, experiment_id, parent, 7)
    assert tracker.run_id is not None
    epochs = 5
    for e in range(epochs):
        tracker.log_epoch(e, epoch_metrics(e))
        if e == 2:
            tracker.log_system({"system/gpu_utilization": 80.0})
    ckpt = tmp_path / "best.pt"
    ckpt.write_bytes(b"weights")
    # the trainer's, known at its end: ride along with the final request
    tracker.log_params({"effective_lr": 0.025, "effective_batch_size": 20})
    assert tracker.finish(
        "completed", summary_metrics={"best_val_acc": 0.49, "test_acc": 0.47}, artifacts=[ckpt]
    )
    # enqueue cost on the training thread: target <= 5 ms (GIL hand-offs to the sender thread
    # can stretch single calls on a loaded 2-core CI box, hence the looser max)
    # Wall time of each call: the median says it never waits for the server; one call's
    # maximum is a preemption's on a loaded machine (bench/tracking.py measures the tail).
    assert statistics.median(tracker.stats.enqueue_s) < 0.005

    run = client.get_run(tracker.run_id)
    assert run.info.run_name == "trial-7"
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["mlflow.parentRunId"] == parent
    assert tags["optuna.trial_number"] == "7"
    assert tags["hpsearch.study"] == "s"
    assert tags["hpsearch.worker"] == "w0"
    assert tags["hpsearch.host"] == "node1"
    assert tags["hpsearch.gpu"] == "0"
    assert tags["hpsearch.outcome"] == "completed"
    assert INCOMPLETE_TAG not in tags
    assert run.data.params == {
        "lr": "0.1",
        "batch_size": "32",
        "arch": "resnet18",
        "effective_lr": "0.025",
        "effective_batch_size": "20",
    }
    for key in EPOCH:
        hist = client.get_metric_history(tracker.run_id, key)
        assert sorted(m.step for m in hist) == list(range(epochs)), key
    val = {m.step: m.value for m in client.get_metric_history(tracker.run_id, "val_acc")}
    assert val[4] == pytest.approx(0.49)
    assert run.data.metrics["best_val_acc"] == pytest.approx(0.49)
    assert run.data.metrics["test_acc"] == pytest.approx(0.47)
    assert len(client.get_metric_history(tracker.run_id, "system/gpu_utilization")) == 1
    assert [a.path for a in client.list_artifacts(tracker.run_id)] == ["best.pt"]

    # Batching: 1 request for the params, exactly 1 per epoch, 1 final (summary + tags).
    mine = [b for b in client.batches if b[0] == tracker.run_id]
    epoch_requests = [b for b in mine if b[1] >= len(EPOCH) and b[2] == 0]
    assert len(epoch_requests) == epochs + 0  # summary batch has 2 metrics, not counted
    assert len(mine) == 1 + epochs + 1
    assert mine[0][2] == 3  # params first
    assert mine[-1][2] == 2  # the trainer's effective lr and batch size, with the end
    assert tracker.stats.requests == len(mine)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("outcome", "kwargs"),
    [
        ("pruned", {"pruned_at_epoch": 3}),
        ("interrupted", {}),
        ("out_of_memory", {"traceback": "Traceback...\ntorch.OutOfMemoryError: CUDA OOM\n"}),
        ("diverged", {"reason": "val_loss is nan"}),
    ],
)
def test_terminal_status_and_tags_on_the_run(
    client: CountingClient,
    experiment_id: str,
    tmp_path: Path,
    outcome: str,
    kwargs: dict[str, object],
) -> None:
    parent = open_study_run(client, experiment_id, "s", {}, "")
    tracker = make_tracker(client, experiment_id, parent, 1)
    tracker.log_epoch(0, epoch_metrics(0))
    tracker.finish(outcome, **kwargs)
    assert tracker.run_id is not None
    run = client.get_run(tracker.run_id)
    assert run.info.status == OUTCOME_STATUS[outcome]
    tags = run.data.tags
    assert tags["hpsearch.outcome"] == outcome
    artifacts = [a.path for a in client.list_artifacts(tracker.run_id)]
    if outcome == "pruned":
        assert tags["hpsearch.pruned_at_epoch"] == "3"
    if outcome == "out_of_memory":
        assert tags["hpsearch.reason"] == "out_of_memory"
        assert artifacts == ["traceback.txt"]
        text = Path(client.download_artifacts(tracker.run_id, "traceback.txt", str(tmp_path)))
        assert "CUDA OOM" in text.read_text()
    else:
        assert artifacts == []
    if outcome == "diverged":
        assert tags["hpsearch.reason"] == "val_loss is nan"


@pytest.mark.slow
def test_context_manager_marks_exceptions_failed(
    client: CountingClient, experiment_id: str
) -> None:
    parent = open_study_run(client, experiment_id, "s", {}, "")
    tracker = make_tracker(client, experiment_id, parent, 2)
    with pytest.raises(RuntimeError, match="kaboom"), tracker:
        tracker.log_epoch(0, epoch_metrics(0))
        raise RuntimeError("kaboom")
    assert tracker.run_id is not None
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["hpsearch.reason"] == "RuntimeError: kaboom"
    assert [a.path for a in client.list_artifacts(tracker.run_id)] == ["traceback.txt"]


@pytest.mark.slow
def test_a_ctrl_c_while_the_run_ends_still_gives_it_its_status(
    client: CountingClient, experiment_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI: `train` stopped twice (its second Ctrl-C raises KeyboardInterrupt) while its run
    ended left the run RUNNING for good. Now it gets its status, marked incomplete, and
    the interrupt goes on."""
    parent = open_study_run(client, experiment_id, "s", {}, "")
    tracker = make_tracker(client, experiment_id, parent, 4)
    tracker.log_epoch(0, epoch_metrics(0))
    model = tmp_path / "best.pt"
    model.write_bytes(b"weights")

    def ctrl_c(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "log_artifact", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        tracker.finish("interrupted", artifacts=[model])
    assert tracker.run_id is not None
    run = client.get_run(tracker.run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags[INCOMPLETE_TAG] == "true"
    assert run.data.tags["hpsearch.outcome"] == "interrupted"  # the final batch went first
    assert tracker.finish("failed") is False  # ended once: a later fail changes nothing
    assert client.get_run(tracker.run_id).info.status == "KILLED"


@pytest.mark.slow
def test_non_numeric_metrics_are_dropped_not_raised(
    client: CountingClient, experiment_id: str, tracking_logs: pytest.LogCaptureFixture
) -> None:
    parent = open_study_run(client, experiment_id, "s", {}, "")
    tracker = make_tracker(client, experiment_id, parent, 3)
    tracker.log_epoch(0, {"val_acc": 0.5, "oops": "n/a"})
    tracker.log_epoch(1, {"val_acc": float("nan")})
    assert tracker.finish("completed")
    assert tracker.run_id is not None
    hist = client.get_metric_history(tracker.run_id, "val_acc")
    assert sorted(m.step for m in hist) == [0, 1]
    assert "dropped non-numeric metrics ['oops']" in tracking_logs.text


def test_unreachable_server_disables_tracker_without_raising(
    tracking_logs: pytest.LogCaptureFixture,
) -> None:
    dead = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    tracker = make_tracker(dead, "0", "parent", 9, start_timeout_s=1.0)
    assert tracker.run_id is None and not tracker.enabled
    assert tracker.unreachable  # the worker tries again later (worker._LateRun)
    tracker.log_epoch(0, epoch_metrics(0))
    tracker.log_system({"system/gpu_utilization": 1.0})
    assert tracker.finish("completed") is False
    assert time.monotonic() - t0 < 30
    assert "could not create the run of trial 9 yet" in tracking_logs.text


def test_a_refused_create_disables_the_tracker_for_good(
    tracking_logs: pytest.LogCaptureFixture,
) -> None:
    """A server that refuses the run (a bad request, a permission) is not tried again."""

    class Refusing(MlflowClient):
        def create_run(self, *args: Any, **kwargs: Any) -> Any:
            raise MlflowException.invalid_parameter_value("no such experiment")

    tracker = make_tracker(Refusing("http://127.0.0.1:9"), "0", "parent", 9, start_timeout_s=5.0)
    assert tracker.run_id is None and not tracker.unreachable
    assert "could not create the run of trial 9, tracking disabled" in tracking_logs.text


def test_an_offline_run_is_kept_whole_and_made_when_the_server_answers(
    client: CountingClient, tmp_path: Path
) -> None:
    """A trial that ended while the server was down (worker._LateRun): its run is kept in
    the spool folder, parameters, epochs, GPU samples, end and artifacts, and made on
    replay under the study's run, dated from the trial's start, found by its key."""
    name = f"offline-{uuid.uuid4().hex[:8]}"
    spool = tmp_path / "spool"
    dead = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")  # no call is made
    started_ms = int(time.time() * 1000) - 60_000
    tracker = TrialTracker(
        dead, "", "", trial_number=4, study_name=name,
        params=trial_params({"lr": 0.1}, arch="resnet18"),
        worker="w0", host="node1", gpu="0", start_time_ms=started_ms,
        run_key="k" * 32, spool_dir=spool, offline=True,
    )  # fmt: skip
    assert tracker.enabled and tracker.run_id is None
    for e in (1, 2):
        tracker.log_system({"system/gpu_utilization": 90.0})
        tracker.log_epoch(e, epoch_metrics(e))
    plot = tmp_path / "learning_curve.png"
    plot.write_bytes(b"png")
    assert tracker.finish("pruned", 2, {"best_val_acc": 0.6}, [plot]) is False
    plot.unlink()  # the caller's temporary folder goes
    (record,) = spool.glob(f"*{SPOOL_SUFFIX}")
    assert record.name.startswith("new-")

    exp = ensure_experiment(client, name)
    parent = open_study_run(client, exp, name, {}, "")
    assert replay_spool(client, spool) == 1 and list(spool.iterdir()) == []
    (run,) = client.search_runs([exp], "tags.`hpsearch.role` = 'trial'")
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["optuna.trial_number"] == "4"
    assert run.data.tags["hpsearch.run_key"] == "k" * 32
    assert run.data.tags["hpsearch.pruned_at_epoch"] == "2"
    assert run.info.status == "KILLED" and run.info.run_name == "trial-4"  # pruned
    assert run.info.start_time == started_ms
    assert run.data.params["lr"] == "0.1" and run.data.metrics["best_val_acc"] == 0.6
    val = client.get_metric_history(run.info.run_id, "val_acc")
    assert [m.step for m in val] == [1, 2]
    assert len(client.get_metric_history(run.info.run_id, "system/gpu_utilization")) == 2
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"learning_curve.png"}

    # A send cut short after the create (the server went away again) finds that run.
    from hpsearch.tracking.mlflow_logger import _made_run

    create = {"experiment": name, "tags": {}, "trial_number": 4, "run_key": "k" * 32}
    assert _made_run(client, create) == run.info.run_id


def _failed_try(
    client: CountingClient, experiment_id: str, epochs: tuple[int, ...]
) -> tuple[str, TrialTracker]:
    """A study run, and trial 1's run as a try that logged `epochs` and was stopped."""
    parent = open_study_run(client, experiment_id, "s", {}, "x: 1\n")
    failed = make_tracker(client, experiment_id, parent, 1)
    for e in epochs:
        failed.log_epoch(e, epoch_metrics(e))
    failed.finish("interrupted")
    assert failed.run_id is not None
    return parent, failed


def test_a_retrys_run_gets_the_epochs_before_its_resume_from_its_checkpoint(
    client: CountingClient, experiment_id: str
) -> None:
    """A retry resumes from its failed try's checkpoint (epoch 3 here); its run held the
    epochs from the resume on only, and its charts began there. The earlier ones are the
    checkpoint's (epoch 2 never reached the failed try's run: the try was killed with it
    queued), dated as that run logged them; not the one it trained past its checkpoint
    (epoch 4, trained again by the retry): each step once, with the retry's value."""
    parent, failed = _failed_try(client, experiment_id, (1, 3, 4))
    checkpoint = [(e, epoch_metrics(e)) for e in (1, 2, 3)]

    made_at = int(time.time() * 1000)
    retry = make_tracker(client, experiment_id, parent, 2)
    retry.copy_history(4, failed.run_id, list(EPOCH), checkpoint)
    for e in (4, 5):
        retry.log_epoch(e, epoch_metrics(e + 10))
    assert retry.finish("completed")
    assert retry.run_id is not None
    for key in EPOCH:
        steps = [m.step for m in client.get_metric_history(retry.run_id, key)]
        assert sorted(steps) == [1, 2, 3, 4, 5], key
    val = {m.step: m.value for m in client.get_metric_history(retry.run_id, "val_acc")}
    assert val == pytest.approx({e: EPOCH["val_acc"] + e / 100 for e in (1, 2, 3)}
                                | {e: EPOCH["val_acc"] + (e + 10) / 100 for e in (4, 5)})  # fmt: skip
    earlier = {m.step: m.timestamp for m in client.get_metric_history(failed.run_id, "lr")}
    copied = {m.step: m.timestamp for m in client.get_metric_history(retry.run_id, "lr")}
    assert (copied[1], copied[3]) == (earlier[1], earlier[3])  # when they were trained
    # not in that run: dated at the retry's start, before its own epochs
    assert made_at <= copied[2] <= copied[4]
    run = client.get_run(retry.run_id)
    assert run.data.tags[HISTORY_TAG] == failed.run_id
    assert INCOMPLETE_TAG not in run.data.tags

    # A custom trainer's checkpoint holds no history: the failed try's run's epochs.
    other = make_tracker(client, experiment_id, parent, 3)
    other.copy_history(4, failed.run_id, ["val_acc", "lr"])
    other.log_epoch(4, epoch_metrics(14))
    assert other.finish("completed")
    assert other.run_id is not None
    val = {m.step: m.value for m in client.get_metric_history(other.run_id, "val_acc")}
    assert val == pytest.approx({1: EPOCH["val_acc"] + 0.01, 3: EPOCH["val_acc"] + 0.03,
                                 4: EPOCH["val_acc"] + 0.14})  # fmt: skip
    # only the keys asked for are copied
    assert [m.step for m in client.get_metric_history(other.run_id, "train_loss")] == [4]

    # A failed try's run MLflow does not have (deleted for good; it answers no values):
    # the checkpoint's epochs go, undated by it; with no checkpoint, nothing, and no tag.
    for number, known in ((4, checkpoint), (5, [])):
        third = make_tracker(client, experiment_id, parent, number)
        third.copy_history(3, uuid.uuid4().hex, list(EPOCH), known)
        third.log_epoch(3, epoch_metrics(3))
        assert third.finish("completed")
        assert third.run_id is not None
        steps = [m.step for m in client.get_metric_history(third.run_id, "val_acc")]
        assert steps == ([1, 2, 3] if known else [3])
        assert (HISTORY_TAG in client.get_run(third.run_id).data.tags) == bool(known)


def test_a_retrys_earlier_epochs_kept_offline_are_sent_when_the_server_answers(
    client: CountingClient, experiment_id: str, tmp_path: Path
) -> None:
    """The server was down as the retry's run would start: its earlier epochs are kept in
    the spool folder with the run (never dropped for later epochs when the buffer is full),
    dated from the failed try's run when the server answers."""
    _, failed = _failed_try(client, experiment_id, (1, 2, 3))
    name = client.get_experiment(experiment_id).name
    spool = tmp_path / "spool"
    dead = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")  # no call is made
    retry = TrialTracker(
        dead, "", "", trial_number=2, study_name=name, params={"effective_lr": 0.1},
        worker="w0", spool_dir=spool, offline=True, max_buffer=4,
    )  # fmt: skip
    retry.copy_history(3, failed.run_id, list(EPOCH), [(e, epoch_metrics(e)) for e in (1, 2)])
    # Params, the copy, three epochs and the end: two more batches than the buffer holds.
    # Epochs 3 and 4 are dropped, not the params or the copy queued before them.
    for e in (3, 4, 5):
        retry.log_epoch(e, epoch_metrics(e + 10))
    assert retry.finish("completed") is False
    assert replay_spool(client, spool) == 1
    (run,) = client.search_runs([experiment_id], "tags.`optuna.trial_number` = '2'")
    val = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_acc")}
    assert val == pytest.approx({1: EPOCH["val_acc"] + 0.01, 2: EPOCH["val_acc"] + 0.02,
                                 5: EPOCH["val_acc"] + 0.15})  # fmt: skip
    assert run.data.params == {"effective_lr": "0.1"}
    earlier = {m.step: m.timestamp for m in client.get_metric_history(failed.run_id, "val_acc")}
    copied = {m.step: m.timestamp for m in client.get_metric_history(run.info.run_id, "val_acc")}
    assert (copied[1], copied[2]) == (earlier[1], earlier[2])
    assert run.data.tags[HISTORY_TAG] == failed.run_id
    assert run.data.tags[INCOMPLETE_TAG] == "true"  # epochs 3 and 4 were dropped


class LostReplyClient(CountingClient):
    """The server makes the run, and the reply to the first create is lost (a 503 from a
    proxy, a timeout): what a retry must not turn into a second run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.creates = 0

    def create_run(self, *args: Any, **kwargs: Any) -> Any:
        run = super().create_run(*args, **kwargs)
        self.creates += 1
        if self.creates == 1:
            raise MlflowException("reply lost", error_code="TEMPORARILY_UNAVAILABLE")
        return run


@pytest.mark.parametrize("keyed", [True, False])
def test_a_create_retried_after_a_lost_reply_makes_one_run(
    mlflow_server: LocalServer, experiment_id: str, keyed: bool
) -> None:
    parent = open_study_run(MlflowClient(mlflow_server.url), experiment_id, "s", {}, "x: 1\n")
    client = LostReplyClient(tracking_uri=mlflow_server.url)
    key = uuid.uuid4().hex
    number = 40 + keyed
    tracker = make_tracker(
        client, experiment_id, parent, number, run_key=key if keyed else None,
        initial_backoff_s=0.05,
    )  # fmt: skip
    assert tracker.run_id is not None
    tracker.finish("completed")
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`optuna.trial_number` = '{number}'"
    )
    if keyed:  # the retry found the run the lost reply had made
        assert client.creates == 1
        assert [r.info.run_id for r in runs] == [tracker.run_id]
        assert claim_run_by_key(client, experiment_id, key, number) == tracker.run_id
        assert claim_run_by_key(client, experiment_id, key, number + 1) is None
        assert runs[0].data.tags["hpsearch.run_key"] == key
    else:  # what the key prevents
        assert client.creates == 2 and len(runs) == 2


class TwinClient(CountingClient):
    """The server made the run twice: MLflow's client itself retried the create, whose
    first reply was lost (it retries POSTs too), and returned the second."""

    def create_run(self, *args: Any, **kwargs: Any) -> Any:
        super().create_run(*args, **kwargs)
        return super().create_run(*args, **kwargs)


def test_a_twin_made_by_the_clients_own_retry_is_deleted_when_the_run_ends(
    mlflow_server: LocalServer, experiment_id: str
) -> None:
    plain = MlflowClient(mlflow_server.url)
    parent = open_study_run(plain, experiment_id, "s", {}, "x: 1\n")
    key = uuid.uuid4().hex
    tracker = make_tracker(TwinClient(tracking_uri=mlflow_server.url), experiment_id, parent, 50,
                           run_key=key)  # fmt: skip
    tracker.log_epoch(1, epoch_metrics(1))
    assert tracker.finish("completed")
    runs = plain.search_runs(
        [experiment_id], "tags.`optuna.trial_number` = '50'", run_view_type=ViewType.ALL
    )
    assert len(runs) == 2  # both were made ...
    live = [r.info.run_id for r in runs if r.info.lifecycle_stage == "active"]
    assert live == [tracker.run_id]  # ... and the empty one is in MLflow's trash
    assert plain.get_run(tracker.run_id).data.metrics["val_acc"] == epoch_metrics(1)["val_acc"]


def test_claiming_a_run_by_key_keeps_the_one_with_metrics(
    mlflow_server: LocalServer, experiment_id: str
) -> None:
    """The launcher claims a dead worker's unlinked run by its key: of twins, the one the
    worker logged to, whichever was made first."""
    client = MlflowClient(mlflow_server.url)
    key = uuid.uuid4().hex
    tags = {"hpsearch.run_key": key, "optuna.trial_number": "60"}
    empty = client.create_run(experiment_id, tags=tags).info.run_id
    used = client.create_run(experiment_id, tags=tags).info.run_id
    client.log_metric(used, "val_acc", 0.5, step=1)
    assert claim_run_by_key(client, experiment_id, key, 60) == used
    assert client.get_run(empty).info.lifecycle_stage == "deleted"
    assert claim_run_by_key(client, experiment_id, key, 60) == used  # once is enough


# --------------------------------------------------------------------------- outage


@pytest.mark.slow
def test_outage_mid_trial_buffers_and_delivers_after_restart(
    tmp_path: Path, tracking_logs: pytest.LogCaptureFixture
) -> None:
    workdir = tmp_path / "outage"
    server: LocalServer = start_local_server(workdir)
    port = server.port
    client = CountingClient(tracking_uri=server.url)
    exp = ensure_experiment(client, "outage")
    parent = open_study_run(client, exp, "outage", {}, "")
    survivor = make_tracker(client, exp, parent, 0, flush_timeout_s=120.0, max_backoff_s=2.0)
    lost = make_tracker(client, exp, parent, 1, flush_timeout_s=1.0, max_backoff_s=2.0)
    small = make_tracker(client, exp, parent, 2, max_buffer=1, max_backoff_s=2.0)
    spool = tmp_path / "spool"
    kept = make_tracker(client, exp, parent, 3, flush_timeout_s=1.0, max_backoff_s=2.0,
                        spool_dir=spool)  # fmt: skip
    trackers = (survivor, lost, small, kept)
    for e in range(2):
        for t in trackers:
            t.log_epoch(e, epoch_metrics(e))
            assert t.flush(30)

    server.stop()
    t0 = time.perf_counter()
    for e in range(2, 5):
        for t in trackers:
            t.log_epoch(e, epoch_metrics(e))
    # Enqueueing never waits for the dead server: a blocked sender would wait out MLflow's
    # retries (seconds); 1 s leaves room for a loaded machine's scheduling.
    assert time.perf_counter() - t0 < 1.0

    # The server is still down when `lost` finishes: bounded wait, no exception.
    t0 = time.monotonic()
    assert lost.finish("completed") is False
    assert time.monotonic() - t0 < 60
    assert lost.incomplete and lost.stats.batches_dropped >= 3
    # One with a spool folder keeps them, with its end and its artifacts (a top-k trial's
    # best model, whose checkpoint_uri Optuna already holds; the caller deletes its files),
    # for when the server answers.
    model = tmp_path / "snapshot" / "best.pt"
    model.parent.mkdir()
    model.write_bytes(b"weights" * 1000)
    folder = tmp_path / "artifacts" / "checkpoint"
    folder.mkdir(parents=True)
    (folder / "best.pt").symlink_to(model)
    plot = tmp_path / "artifacts" / "learning_curve.png"
    plot.write_bytes(b"png")
    assert (
        kept.finish("completed", summary_metrics={"best_val_acc": 0.7}, artifacts=[plot, folder])
        is False
    )
    shutil.rmtree(tmp_path / "artifacts")
    shutil.rmtree(model.parent)
    assert kept.stats.batches_dropped == 0 and kept.run_id is not None
    assert sorted(p.name for p in spool.iterdir()) == [
        f"{kept.run_id}.artifacts", f"{kept.run_id}{SPOOL_SUFFIX}"
    ]  # fmt: skip

    restarted = start_local_server(workdir, port=port)
    try:
        assert replay_spool(client, spool) == 1 and list(spool.iterdir()) == []
        kept_run = client.get_run(kept.run_id)
        assert kept_run.info.status == "FINISHED" and INCOMPLETE_TAG not in kept_run.data.tags
        kept_files = {a.path for a in client.list_artifacts(kept.run_id)}
        assert kept_files == {"learning_curve.png", "checkpoint"}, kept_files
        got = client.download_artifacts(kept.run_id, "checkpoint/best.pt", str(tmp_path))
        assert Path(got).read_bytes() == b"weights" * 1000
        assert sorted(m.step for m in client.get_metric_history(kept.run_id, "val_acc")) == [
            0, 1, 2, 3, 4,
        ]  # fmt: skip
        assert kept_run.data.metrics["best_val_acc"] == 0.7
        assert survivor.finish("completed", summary_metrics={"best_val_acc": 0.5}) is True
        assert survivor.run_id is not None and lost.run_id is not None
        run = client.get_run(survivor.run_id)
        assert run.info.status == "FINISHED"
        assert INCOMPLETE_TAG not in run.data.tags
        hist = client.get_metric_history(survivor.run_id, "val_acc")
        assert sorted(m.step for m in hist) == [0, 1, 2, 3, 4]
        assert run.data.metrics["best_val_acc"] == 0.5
        # The other run kept what was delivered before the outage and stays RUNNING
        # (its status could not be sent) - best-effort by design.
        lost_run = client.get_run(lost.run_id)
        assert sorted(m.step for m in client.get_metric_history(lost.run_id, "val_acc")) == [0, 1]
        assert lost_run.info.status == "RUNNING"
        # A tracker whose bounded buffer overflowed during the outage tags its run.
        assert small.finish("completed") is False and small.run_id is not None
        small_run = client.get_run(small.run_id)
        assert small_run.data.tags[INCOMPLETE_TAG] == "true"
        assert small_run.info.status == "FINISHED"
        steps = sorted(m.step for m in client.get_metric_history(small.run_id, "val_acc"))
        # Buffer 1 + 1 in flight: of epochs 2-4 (and the final batch) one or two survive,
        # by when the sender, which runs at a lower priority than this thread, takes the
        # next one; never all three.
        assert steps[:2] == [0, 1] and 3 <= len(steps) <= 4, steps
        assert small.stats.batches_dropped >= 1
    finally:
        restarted.stop()
    assert "server unreachable" in tracking_logs.text
    assert "reachable again" in tracking_logs.text


_NOTEBOOK_PROBE = """
import json, sys
from hpsearch.tracking.mlflow_logger import apply_http_policy
from mlflow.tracking import MlflowClient
apply_http_policy()
client = MlflowClient(sys.argv[1])
run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
client.set_terminated(run.info.run_id)  # probes for a Databricks notebook too
from mlflow.utils import databricks_utils
print(json.dumps({"ipython": "IPython" in sys.modules,
                  "patched": databricks_utils._get_dbutils.__module__ != databricks_utils.__name__,
                  "status": client.get_run(run.info.run_id).info.status}))
"""


@pytest.mark.parametrize("databricks", [False, True])
def test_databricks_notebook_probe_is_skipped_outside_databricks(
    mlflow_server: LocalServer, databricks: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABRICKS_RUNTIME_VERSION"}
    if databricks:
        env["DATABRICKS_RUNTIME_VERSION"] = "15.4"
    out = subprocess.run(
        [sys.executable, "-c", _NOTEBOOK_PROBE, mlflow_server.url],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["status"] == "FINISHED"  # requests work as before
    assert seen["patched"] != databricks  # in a Databricks runtime MLflow's probe stays
    try:
        import IPython  # noqa: F401
    except ImportError:
        return  # nothing to tell apart: the probe fails fast either way
    if not databricks:  # no IPython import behind the requests (0.35 s of CPU)
        assert not seen["ipython"]


def test_a_reason_or_tag_quoting_a_url_never_holds_its_password() -> None:
    """Only a tag that was a URL as a whole was masked: a failure's reason quoting the
    database's or MLflow's URL went to the run with the password in it."""
    from hpsearch.tracking.mlflow_logger import REASON_TAG, _safe_tag_value, terminal_tags

    reason = "storage: cannot connect to postgresql://bob:S3CRET@db/optuna"
    for tags in (terminal_tags("error", None, reason), terminal_tags("pruned", 2, reason)):
        assert "S3CRET" not in tags[REASON_TAG] and "bob:***@db" in tags[REASON_TAG]
    assert _safe_tag_value("failed: http://u:S3CRET@h/x") == "failed: http://u:***@h/x"
    assert _safe_tag_value("http://u:S3CRET@h/x") == "http://u:***@h/x"


class _SpoolClient:
    """What replay_spool calls, recorded; `fail` raises on log_batch."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail

    def log_batch(
        self, run_id: str, metrics: Any, params: Any, tags: Any, synchronous: bool
    ) -> None:
        if self.fail is not None:
            raise self.fail
        self.calls.append(("batch", (run_id, [(m.key, m.value, m.step) for m in metrics])))

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.calls.append(("tag", (run_id, key, value)))

    def get_run(self, run_id: str) -> Any:
        if self.get_fails is not None:
            raise self.get_fails
        from types import SimpleNamespace

        return SimpleNamespace(data=SimpleNamespace(tags={}))  # no tag on its runs

    def log_text(self, run_id: str, text: str, name: str) -> None:
        self.calls.append(("text", (run_id, name)))

    def set_terminated(self, run_id: str, status: str, end_time: int | None) -> None:
        self.calls.append(("end", (run_id, status, end_time)))

    def log_artifact(self, run_id: str, path: str) -> None:
        if self.refuse_files is not None:
            raise self.refuse_files
        self.calls.append(("file", (run_id, Path(path).name)))

    def log_artifacts(self, run_id: str, path: str, artifact_path: str) -> None:
        self.calls.append(("folder", (run_id, artifact_path)))

    refuse_files: Exception | None = None
    get_fails: Exception | None = None


def test_kept_runs_are_sent_once_with_their_end_time_and_a_dead_claim_is_taken_back(
    tmp_path: Path,
) -> None:
    from hpsearch.tracking.mlflow_logger import _Batch, write_spool

    spool = tmp_path / "spool"
    batch = _Batch(metrics=[Metric("val_acc", math.nan, 5, 3)], tags=[RunTag("a", "b")])
    write_spool(spool, "r1", [batch], "FINISHED", incomplete=True, traceback="tb")
    end_ms = json.loads((spool / f"r1{SPOOL_SUFFIX}").read_text())["end_ms"]
    # A process of this host that died while sending r2 left it claimed.
    write_spool(spool, "r2", [], "KILLED", incomplete=False, traceback=None)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (spool / f"r2{SPOOL_SUFFIX}").rename(
        spool / f".r2{SPOOL_SUFFIX}.{socket.gethostname()}.{dead}.sending"
    )
    down = _SpoolClient(MlflowException("unreachable"))  # no HTTP status: transient
    assert replay_spool(down, spool) == 0  # type: ignore[arg-type]
    assert sorted(p.name for p in spool.iterdir()) == [f"r1{SPOOL_SUFFIX}", f"r2{SPOOL_SUFFIX}"]
    up = _SpoolClient()
    assert replay_spool(up, spool) == 2 and list(spool.iterdir()) == []  # type: ignore[arg-type]
    r1 = [c for c in up.calls if c[1][0] == "r1"]
    assert r1[0][0] == "batch" and math.isnan(r1[0][1][1][0][1])  # NaN survives the file
    assert [c[0] for c in r1] == ["batch", "tag", "text", "end"]
    assert r1[-1][1] == ("r1", "FINISHED", end_ms)  # ended then, not when sent
    # A run the server does not have (404) is set aside, not retried forever; a proxy's
    # 404 page while MLflow behind it is down keeps it for the next try.
    write_spool(spool, "r3", [batch], "FINISHED", incomplete=False, traceback=None)
    assert replay_spool(_SpoolClient(_proxy_404()), spool) == 0  # type: ignore[arg-type]
    assert [p.name for p in spool.iterdir()] == [f"r3{SPOOL_SUFFIX}"]
    gone = _SpoolClient(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "x"}))
    assert replay_spool(gone, spool) == 0  # type: ignore[arg-type]
    assert [p.name for p in spool.iterdir()] == [f"r3{SPOOL_SUFFIX}.failed"]


class _DeletedRunClient(_SpoolClient):
    """A server on which run `deleted` is in the trash: MLflow answers 400 to its writes."""

    deleted = "r1"

    def _refuse(self, run_id: str) -> None:
        if run_id == self.deleted:
            raise RestException({"error_code": "INVALID_PARAMETER_VALUE",
                                 "message": "The run r1 must be in the 'active' state."})  # fmt: skip

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self._refuse(run_id)
        super().set_tag(run_id, key, value)

    def set_terminated(self, run_id: str, status: str, end_time: int | None) -> None:
        self._refuse(run_id)
        super().set_terminated(run_id, status, end_time)

    def get_run(self, run_id: str) -> Any:
        from types import SimpleNamespace

        stage = "deleted" if run_id == self.deleted else "active"
        return SimpleNamespace(info=SimpleNamespace(lifecycle_stage=stage),
                               data=SimpleNamespace(tags={}))  # fmt: skip


class _ProxyError(_SpoolClient):
    """A proxy in front of MLflow that answers every call with a 400 page."""

    def __init__(self) -> None:
        super().__init__(RestException({"error_code": "BAD_REQUEST", "message": "<html>"}))
        self.refuse_files = self.get_fails = self.fail

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        raise self.fail  # type: ignore[misc]

    def set_terminated(self, run_id: str, status: str, end_time: int | None) -> None:
        raise self.fail  # type: ignore[misc]

    def log_artifacts(self, run_id: str, path: str, artifact_path: str) -> None:
        raise self.fail  # type: ignore[misc]


def test_a_kept_run_deleted_in_the_ui_is_set_aside_and_those_after_it_are_sent(
    tmp_path: Path,
) -> None:
    """It used to be put back as if the server were down: every later kept run waited
    behind it for good, RUNNING, and its files were uploaded again at each try."""
    from hpsearch.tracking.mlflow_logger import _Batch, write_spool

    spool = tmp_path / "spool"
    batch = _Batch(metrics=[Metric("val_acc", 0.5, 5, 1)])
    for run in ("r1", "r2"):
        write_spool(spool, run, [batch], "FINISHED", incomplete=True, traceback=None)
    client = _DeletedRunClient()
    assert replay_spool(client, spool) == 1  # type: ignore[arg-type]
    assert [c[1][:2] for c in client.calls if c[0] == "end"] == [("r2", "FINISHED")]
    assert sorted(p.name for p in spool.iterdir()) == [f"r1{SPOOL_SUFFIX}.failed"]
    assert replay_spool(client, spool) == 0  # type: ignore[arg-type]
    # A login refused (401) is every run's: the file waits for the next try.
    write_spool(spool, "r3", [batch], "FINISHED", incomplete=False, traceback=None)
    login = _SpoolClient(RestException({"error_code": "UNAUTHENTICATED", "message": "x"}))
    assert replay_spool(login, spool) == 0  # type: ignore[arg-type]
    assert f"r3{SPOOL_SUFFIX}" in {p.name for p in spool.iterdir()}
    # Review: a 400 of a live run (a proxy's error page; MLflow's own for an error of its
    # database) set every kept run aside, their models deleted: kept for the next try.
    from hpsearch.tracking.mlflow_logger import _artifacts_dir, _keep_artifacts

    model = tmp_path / "best.pt"
    model.write_bytes(b"weights")
    _keep_artifacts(spool, "r3", [model])
    assert replay_spool(_ProxyError(), spool) == 0  # type: ignore[arg-type]
    assert f"r3{SPOOL_SUFFIX}" in {p.name for p in spool.iterdir()}
    assert (_artifacts_dir(spool, "r3") / "best.pt").read_bytes() == b"weights"


def test_a_claim_by_a_reused_pid_is_taken_back(tmp_path: Path) -> None:
    """A process that died sending left its claim; this PID, now another process's
    (here this very process, of another start time), does not keep it claimed."""
    from hpsearch.packing import process_start
    from hpsearch.tracking.mlflow_logger import write_spool

    spool = tmp_path / "spool"
    write_spool(spool, "r1", [], "KILLED", incomplete=False, traceback=None)
    start = (process_start(os.getpid()) or 0) + 1
    (spool / f"r1{SPOOL_SUFFIX}").rename(
        spool / f".r1{SPOOL_SUFFIX}.{socket.gethostname()}.{os.getpid()}-{start}.sending"
    )
    up = _SpoolClient()
    assert replay_spool(up, spool) == 1 and list(spool.iterdir()) == []  # type: ignore[arg-type]


class _FailingAfterFlush(_SpoolClient):
    """A server that took the epochs, then went down as the run's end was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        from types import SimpleNamespace

        self._run = SimpleNamespace(info=SimpleNamespace(run_id="r1"))

    def create_run(self, *a: Any, **k: Any) -> Any:
        return self._run

    def search_runs(self, *a: Any, **k: Any) -> list[Any]:
        return []

    def _check(self) -> None:
        if self.down:
            raise MlflowException("API request failed with exception ConnectionError")

    def log_batch(self, run_id: str, metrics: Any, params: Any, tags: Any,
                  synchronous: bool) -> None:  # fmt: skip
        self._check()
        super().log_batch(run_id, metrics, params, tags, synchronous)

    def log_artifacts(self, run_id: str, path: str, artifact_path: str) -> None:
        self.down = True  # the first upload is where it fails
        self._check()

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self._check()
        super().set_tag(run_id, key, value)

    def set_terminated(self, run_id: str, status: str, end_time: int | None) -> None:
        self._check()
        super().set_terminated(run_id, status, end_time)


def test_a_server_failing_during_a_runs_end_keeps_its_models_and_status_for_later(
    tmp_path: Path,
) -> None:
    """The flush went through, then the uploads failed: the model was lost and the run
    left RUNNING, with nothing kept. Now the rest is kept and sent when it answers."""
    client = _FailingAfterFlush()
    spool = tmp_path / "spool"
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "best.pt").write_bytes(b"weights")
    tracker = TrialTracker(
        client,  # type: ignore[arg-type]
        "1", "p", trial_number=3, study_name="s", params={"lr": 0.1}, host="h", gpu="none",
        spool_dir=spool, run_key="k1",
    )  # fmt: skip
    tracker.log_epoch(1, {"val_acc": 0.5})
    assert tracker.finish("completed", artifacts=[folder], end_time_ms=1234) is False
    assert not any(c[0] == "end" for c in client.calls)
    shutil.rmtree(folder)  # the caller deletes its snapshot: the spool holds a copy
    up = _SpoolClient()
    assert replay_spool(up, spool) == 1 and list(spool.iterdir()) == []  # type: ignore[arg-type]
    assert ("folder", ("r1", "checkpoint")) in up.calls
    assert up.calls[-1] == ("end", ("r1", "FINISHED", 1234))


def test_runs_kept_in_the_folder_earlier_versions_shared_are_left_to_the_server_lacking_them(
    tmp_path: Path,
) -> None:
    """Earlier versions kept one folder for every server: a run this server lacks may be
    another's, so it stays there, files and all (it was set aside and its files deleted),
    and the runs after it are still sent."""
    from hpsearch.tracking.mlflow_logger import _Batch, _keep_artifacts, write_spool

    spool = tmp_path / "mlflow-spool"
    plot = tmp_path / "learning_curve.png"
    plot.write_bytes(b"png")
    batch = _Batch(metrics=[Metric("val_acc", 0.5, 5, 1)])
    for run in ("other", "mine"):
        kept, _ = _keep_artifacts(spool, run, [plot])
        write_spool(spool, run, [batch], "FINISHED", incomplete=False, traceback=None,
                    artifacts=kept)  # fmt: skip

    class _Here(_SpoolClient):
        def log_batch(self, run_id: str, *args: Any, **kwargs: Any) -> None:
            if run_id == "other":
                raise RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "x"})
            super().log_batch(run_id, *args, **kwargs)

    here = _Here()
    assert replay_spool(here, spool, mixed=True) == 1  # type: ignore[arg-type]
    assert sorted(p.name for p in spool.iterdir()) == ["other.artifacts", f"other{SPOOL_SUFFIX}"]
    assert ("end", ("mine", "FINISHED", here.calls[-1][1][2])) == here.calls[-1]
    # Its own server takes it later.
    assert replay_spool(_SpoolClient(), spool, mixed=True) == 1  # type: ignore[arg-type]
    assert list(spool.iterdir()) == []


def test_a_kept_runs_artifacts_are_sent_and_a_refused_one_holds_up_nothing(
    tmp_path: Path,
) -> None:
    """A run kept on disk keeps its artifacts beside it. One the server refuses for good
    (413 from a proxy in front of it) is left out, the run tagged incomplete, and the runs
    after it are sent: before, it went back to the folder and held up every later run. A
    run set aside (404) leaves no copy of its files behind."""
    import requests
    from hpsearch.tracking.mlflow_logger import _Batch, _keep_artifacts, write_spool

    spool = tmp_path / "spool"
    plot = tmp_path / "learning_curve.png"
    plot.write_bytes(b"png")
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "best.pt").write_bytes(b"w")
    batch = _Batch(metrics=[Metric("val_acc", 0.5, 5, 1)])
    for run in ("r1", "r2"):
        kept, complete = _keep_artifacts(spool, run, [plot, folder])
        assert complete and kept == ["learning_curve.png", "checkpoint"]
        write_spool(spool, run, [batch], "FINISHED", incomplete=False, traceback=None,
                    artifacts=kept)  # fmt: skip
    too_large = requests.HTTPError(response=requests.Response())
    assert too_large.response is not None
    too_large.response.status_code = 413
    client = _SpoolClient()
    client.refuse_files = too_large
    assert replay_spool(client, spool) == 2 and list(spool.iterdir()) == []  # type: ignore[arg-type]
    assert ("folder", ("r1", "checkpoint")) in client.calls
    assert ("tag", ("r1", INCOMPLETE_TAG, "true")) in client.calls
    assert client.calls[-1] == ("end", ("r2", "FINISHED", client.calls[-1][1][2]))
    # Down again mid-upload: kept, files and all, for the next try.
    kept, _ = _keep_artifacts(spool, "r3", [plot])
    write_spool(spool, "r3", [], "FINISHED", incomplete=False, traceback=None, artifacts=kept)
    client.refuse_files = requests.ConnectionError("refused")
    assert replay_spool(client, spool) == 0  # type: ignore[arg-type]
    assert sorted(p.name for p in spool.iterdir()) == ["r3.artifacts", f"r3{SPOOL_SUFFIX}"]
    proxy_page = requests.HTTPError(response=requests.Response())  # its artifact route's
    assert proxy_page.response is not None
    proxy_page.response.status_code = 404
    client.refuse_files = proxy_page
    client.get_fails = requests.ConnectionError("down behind the proxy")
    assert replay_spool(client, spool) == 0  # type: ignore[arg-type]
    assert sorted(p.name for p in spool.iterdir()) == ["r3.artifacts", f"r3{SPOOL_SUFFIX}"]
    # MLflow answers for the run: its artifact route is not served, for good (a server
    # without --serve-artifacts). The file is left out and the run sent, not held forever.
    client.get_fails = None
    assert replay_spool(client, spool) == 1 and list(spool.iterdir()) == []  # type: ignore[arg-type]
    assert ("tag", ("r3", INCOMPLETE_TAG, "true")) in client.calls
    gone = _SpoolClient(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "x"}))
    kept, _ = _keep_artifacts(spool, "r3", [plot])
    write_spool(spool, "r3", [batch], "FINISHED", incomplete=False, traceback=None, artifacts=kept)
    assert replay_spool(gone, spool) == 0  # type: ignore[arg-type]
    assert [p.name for p in spool.iterdir()] == [f"r3{SPOOL_SUFFIX}.failed"]


def test_a_kept_run_sent_whole_drops_the_incomplete_mark_the_sweep_gave_it(
    client: CountingClient, experiment_id: str, tmp_path: Path
) -> None:
    """A run kept in the spool folder (the server down at its trial's end) is still RUNNING
    when the launch's end sweeps the runs of gone workers, which marks a trained trial's
    incomplete (its plots never came); the kept record then sends them. The mark went
    with it for good; it goes now, unless the record itself lacks something."""
    from hpsearch.tracking.mlflow_logger import _Batch, write_spool

    spool = tmp_path / "spool"
    for kept_incomplete in (False, True):
        run_id = client.create_run(experiment_id).info.run_id
        client.set_tag(run_id, INCOMPLETE_TAG, "true")  # the sweep's
        batch = _Batch(metrics=[Metric("val_acc", 0.5, int(time.time() * 1000), 1)])
        write_spool(spool, run_id, [batch], "FINISHED", incomplete=kept_incomplete,
                    traceback=None)  # fmt: skip
        assert replay_spool(client, spool) == 1
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert run.data.tags.get(INCOMPLETE_TAG) == ("true" if kept_incomplete else None)
