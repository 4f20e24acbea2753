"""A worker's first trial trains while its MLflow session is still being set up (importing
MLflow costs 1.3 s of CPU): the trial's run starts once the session is ready, dated from the
trial's start, with the epochs from before it timed when they ended. A trial that fails
before the session is ready still gets its run."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from hpsearch.config import load_config
from hpsearch.runs import spool_folder
from hpsearch.storage import StorageSpec
from hpsearch.tracking.server import LocalServer
from hpsearch.worker import WorkerOptions, run_worker
from mlflow.tracking import MlflowClient
from tracking_helpers import UUIDS, FakeGpu, FakeNVML

SETUP_S = 5.0  # s: the MLflow set-up is held up this long, past the first trial's epochs


@pytest.fixture
def slow_setup(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    import hpsearch.runs as runs

    seen: dict[str, float] = {}
    real = runs._client

    def slow(uri: str) -> Any:
        time.sleep(SETUP_S)
        seen["ready_ms"] = time.time() * 1000
        return real(uri)

    monkeypatch.setattr(runs, "_client", slow)
    return seen


def _two_trials(tmp_path: Path, url: str, name: str, *overrides: str, n: int = 2) -> Path:
    """A worker runs `n` 3-epoch trials of the tiny study `name` with the dummy trainer,
    tracked at `url`, on a journal it returns."""
    cfg = load_config(
        "tiny",
        overrides=[f"name={name}", f"budget.n_trials={n}", "budget.max_epochs=3",
                   "pruner={name: none}", *overrides],
    )  # fmt: skip
    journal = tmp_path / "optuna.journal"
    spec = StorageSpec("journal", str(journal), "journal")
    opts = WorkerOptions(
        workdir=tmp_path, worker_id="w0", train_fn="dummy_trainer:train", tracking_uri=url
    )
    assert run_worker(cfg, spec, opts).outcomes == {"finished": n}
    return journal


def _trial_runs(client: MlflowClient, name: str) -> list[Any]:
    exp = client.get_experiment_by_name(name)
    assert exp is not None
    return list(client.search_runs([exp.experiment_id], "tags.`hpsearch.role` = 'trial'"))


def _study(journal: Path, name: str) -> optuna.Study:
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))
    )
    return optuna.load_study(study_name=name, storage=storage)


def test_first_trial_trains_before_mlflow_is_ready(
    tmp_path: Path,
    mlflow_server: LocalServer,
    slow_setup: dict[str, float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "0.2")  # 3 epochs end well before SETUP_S
    # One fake GPU (NVML's functions) the worker's sampler reads every 0.1 s.
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML([FakeGpu(UUIDS[0])]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # ... as the GPU the trial trains on: on a machine without CUDA, the sampler of a trial
    # on the CPU (--device auto there) samples none.
    from hpsearch.tracking import gpu

    monkeypatch.setattr(gpu, "trial_gpu_index", lambda device, cuda: 0)
    name = f"late-{time.time_ns()}"
    began_ms = time.time() * 1000
    journal = _two_trials(tmp_path, mlflow_server.url, name, "tracking.gpu_interval_s=0.1")
    client = MlflowClient(mlflow_server.url)
    runs = _trial_runs(client, name)
    by_number = {int(r.data.tags["optuna.trial_number"]): r for r in runs}
    assert sorted(by_number) == [0, 1]
    for t in _study(journal, name).trials:
        run = by_number[t.number]
        assert t.user_attrs["mlflow_run_id"] == run.info.run_id
        assert run.data.tags["hpsearch.run_key"] == t.user_attrs["mlflow_run_key"]  # unique
        assert len(t.user_attrs["mlflow_run_key"]) == 32
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "val_acc")
        assert [m.step for m in history] == [1, 2, 3]
        assert [m.value for m in history] == [t.intermediate_values[s] for s in (1, 2, 3)]
        assert run.info.start_time <= min(m.timestamp for m in history)
    first = by_number[0]
    epochs = client.get_metric_history(first.info.run_id, "val_acc")
    # The first trial trained while MLflow was held up: its epochs ended before the set-up
    # did, and keep those times (not the time they were sent); its run is dated from the
    # trial's start, not from the set-up's end.
    assert max(m.timestamp for m in epochs) < slow_setup["ready_ms"]
    assert began_ms <= first.info.start_time < slow_setup["ready_ms"] - 0.5 * SETUP_S * 1000
    # Its GPU was sampled from its start too: the samples taken before the run existed
    # reached it with their own times, in order.
    gpu = client.get_metric_history(first.info.run_id, "system/gpu_utilization")
    stamps = [m.timestamp for m in sorted(gpu, key=lambda m: m.step)]
    assert stamps == sorted(stamps) and all(m.value == 90.0 for m in gpu)
    # ms: sampled from the trial's start (the ask's writes and thread starts in between)
    assert first.info.start_time <= stamps[0] < first.info.start_time + 3000
    assert len([t for t in stamps if t < slow_setup["ready_ms"]]) >= 10
    later = client.get_metric_history(by_number[1].info.run_id, "system/gpu_utilization")
    assert later and min(m.timestamp for m in later) >= by_number[1].info.start_time


def test_a_trial_trains_while_a_slow_server_creates_its_run(
    tmp_path: Path, mlflow_server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that takes its time to answer (one that hangs holds a create for minutes)
    does not hold up a trial's start once the worker's session is set up: trial 1 trains
    all its epochs while its run's create waits, and they reach the run after it."""
    hang_s = 4.0  # s: the create of trial 1's run, well past its 3 epochs of 0.2 s
    answered: dict[str, float] = {}
    real = MlflowClient.create_run

    def slow_create(self: MlflowClient, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("run_name") == "trial-1":
            time.sleep(hang_s)
            answered["ms"] = time.time() * 1000
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "create_run", slow_create)
    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "0.2")
    name = f"slow-create-{time.time_ns()}"
    journal = _two_trials(tmp_path, mlflow_server.url, name)
    client = MlflowClient(mlflow_server.url)
    runs = _trial_runs(client, name)
    second = next(r for r in runs if r.data.tags["optuna.trial_number"] == "1")
    trial = _study(journal, name).trials[1]
    assert trial.user_attrs["mlflow_run_id"] == second.info.run_id  # linked after all
    assert second.info.status == "FINISHED"
    epochs = client.get_metric_history(second.info.run_id, "val_acc")
    assert [m.step for m in epochs] == [1, 2, 3]
    # Trained while the create waited: every epoch ended before the server answered.
    assert max(m.timestamp for m in epochs) < answered["ms"] - 1000
    assert trial.datetime_start is not None
    assert second.info.start_time <= min(m.timestamp for m in epochs)


def _down_at_start(
    tmp_path: Path, url: str, name: str, monkeypatch: pytest.MonkeyPatch, retry_s: float
) -> tuple[list[float], Path]:
    """A worker runs one 3-epoch trial of the tiny study `name` with the dummy trainer,
    tracked at `url`, which does not answer the session's set-up and the run's first
    start (its later tries come `retry_s` apart): the times (ms) MLflow was asked for the
    study's experiment, and the journal."""
    import hpsearch.worker as worker
    from hpsearch.tracking import mlflow_logger

    calls: list[float] = []
    real = mlflow_logger.ensure_experiment

    def down_twice(client: MlflowClient, study_name: str) -> str:
        calls.append(time.time() * 1000)
        if len(calls) <= 2:  # the set-up's, then the first start's
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        return real(client, study_name)

    monkeypatch.setattr(mlflow_logger, "ensure_experiment", down_twice)
    monkeypatch.setattr(worker, "RUN_START_RETRY_S", (retry_s,))
    return calls, _two_trials(tmp_path, url, name, n=1)


def test_a_trial_started_while_mlflow_was_down_gets_its_run_when_it_answers(
    tmp_path: Path, mlflow_server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow down when the trial starts (the session's set-up and the run's first start
    both find no server): the trial trains on, the start is tried again, and the run it
    gets holds every epoch, dated from the trial's start, linked to the trial. Before,
    the trial had no run and its epochs were dropped."""
    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "0.1")
    monkeypatch.setenv("HPSEARCH_DUMMY_FINISH_S", "3")  # the trial outlasts both tries
    name = f"down-at-start-{time.time_ns()}"
    began_ms = time.time() * 1000
    calls, journal = _down_at_start(tmp_path, mlflow_server.url, name, monkeypatch, 0.3)
    client = MlflowClient(mlflow_server.url)
    (run,) = _trial_runs(client, name)
    trial = _study(journal, name).trials[0]
    assert len(calls) >= 3  # made on the try after the outage (a 4th: the study summary)
    assert trial.user_attrs["mlflow_run_id"] == run.info.run_id
    assert run.info.status == "FINISHED"
    epochs = client.get_metric_history(run.info.run_id, "val_acc")
    assert [m.step for m in epochs] == [1, 2, 3]
    assert [m.value for m in epochs] == [trial.intermediate_values[s] for s in (1, 2, 3)]
    assert min(m.timestamp for m in epochs) < calls[2]  # trained before the run existed
    assert began_ms <= run.info.start_time <= min(m.timestamp for m in epochs)


def test_a_trial_that_ends_while_mlflow_is_down_keeps_its_run_until_it_answers(
    tmp_path: Path, mlflow_server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server is still down when the trial ends: its run is kept whole in the spool
    folder (epochs, end, plots) and made when the server answers (here at the worker's
    end), found by the trial's run key, and linked by a study attribute that the query
    API reads. Before, the trial had no run at all."""
    import hpsearch.runs as runs
    from hpsearch.query import best_trials

    monkeypatch.setattr(runs.TrackingSession, "answers", lambda self: False)  # at its end
    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "0.05")
    name = f"down-at-end-{time.time_ns()}"
    t0 = time.monotonic()
    _, journal = _down_at_start(tmp_path, mlflow_server.url, name, monkeypatch, 300.0)
    assert time.monotonic() - t0 < 60  # not held for the next try, 300 s away
    client = MlflowClient(mlflow_server.url)
    (run,) = _trial_runs(client, name)  # sent from the spool at the worker's end
    trial = _study(journal, name).trials[0]
    assert run.data.tags["hpsearch.run_key"] == trial.user_attrs["mlflow_run_key"]
    assert "mlflow_run_id" not in trial.user_attrs  # a finished trial takes no attribute
    top = best_trials(name, storage=str(journal))
    assert list(top["mlflow_run_id"]) == [run.info.run_id]
    assert run.info.status == "FINISHED"
    epochs = client.get_metric_history(run.info.run_id, "val_acc")
    assert [m.value for m in epochs] == [trial.intermediate_values[s] for s in (1, 2, 3)]
    assert trial.datetime_start is not None
    assert run.info.start_time == pytest.approx(trial.datetime_start.timestamp() * 1000, abs=2000)
    assert "learning_curve.png" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert not list((tmp_path / "mlflow-spool").rglob("*.json"))
    assert list((tmp_path / "mlflow-spool").iterdir()) == [
        spool_folder(tmp_path, mlflow_server.url, embedded=False)
    ]


def test_runs_kept_for_another_mlflow_server_are_left_for_it(
    tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """A worker on this server sends the runs kept for it, and leaves those kept while
    another server was down: before, it set them aside as runs this one lacks (their
    files deleted), or made their offline runs here."""
    from hpsearch.tracking.mlflow_logger import SPOOL_SUFFIX, _Batch, write_spool
    from mlflow.entities import Metric

    client = MlflowClient(mlflow_server.url)
    name = f"two-servers-{time.time_ns()}"
    mine = client.create_run(client.create_experiment(name)).info.run_id
    batch = _Batch(metrics=[Metric("val_acc", 0.25, int(time.time() * 1000), 1)])
    own = spool_folder(tmp_path, mlflow_server.url, embedded=False)
    other = spool_folder(tmp_path, "https://mlflow.example.com", embedded=False)
    write_spool(own, mine, [batch], "FINISHED", incomplete=False, traceback=None)
    write_spool(other, "theirs", [batch], "FINISHED", incomplete=False, traceback=None)
    _two_trials(tmp_path, mlflow_server.url, name, n=1)
    sent = client.get_run(mine)
    assert sent.info.status == "FINISHED" and sent.data.metrics["val_acc"] == 0.25
    assert [p.name for p in other.iterdir()] == [f"theirs{SPOOL_SUFFIX}"]


@pytest.mark.slow
def test_a_worker_that_joins_the_work_folders_server_sends_the_runs_kept_for_it(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A worker started by hand in a work folder whose embedded server runs (a launch's, or
    `hpsearch ui`'s) joins that server, and its spool folder is the embedded server's,
    whatever port it has now: the runs kept while it was down are sent at the worker's end."""
    from cli_util import DUMMY, hpsearch
    from hpsearch.tracking.mlflow_logger import _Batch, write_spool
    from hpsearch.tracking.server import attach_or_start
    from mlflow.entities import Metric

    server = attach_or_start(tmp_path)  # the embedded server, as `hpsearch ui` starts it
    try:
        client = MlflowClient(server.url)
        name = f"joined-{time.time_ns()}"
        kept = client.create_run(client.create_experiment(name)).info.run_id
        batch = _Batch(metrics=[Metric("val_acc", 0.25, int(time.time() * 1000), 1)])
        folder = spool_folder(tmp_path, server.url, embedded=True)
        write_spool(folder, kept, [batch], "FINISHED", incomplete=False, traceback=None)
        env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "0.01"}
        env.pop("HPSEARCH_EMBEDDED_MLFLOW", None)  # started by hand: no launch told it
        r = hpsearch(["worker", "--study", "tiny", "--workdir", str(tmp_path), "--trials", "1",
                      "--set", f"name={name}", "--set", "budget.max_epochs=1",
                      "--train-fn", DUMMY], env)  # fmt: skip
        assert r.returncode == 0, r.stderr
        sent = client.get_run(kept)
        assert sent.info.status == "FINISHED" and sent.data.metrics["val_acc"] == 0.25
        assert not list(folder.glob("*.json"))
    finally:
        server.release()


def test_a_trial_failing_before_mlflow_is_ready_gets_its_run(
    tmp_path: Path,
    mlflow_server: LocalServer,
    slow_setup: dict[str, float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "0.01")
    name = f"late-fail-{time.time_ns()}"
    cfg = load_config(
        "tiny", overrides=[f"name={name}", "budget.n_trials=1", "budget.max_epochs=2"]
    )
    journal = tmp_path / "optuna.journal"
    spec = StorageSpec("journal", str(journal), "journal")
    opts = WorkerOptions(
        workdir=tmp_path, worker_id="w0", train_fn="test_tracking_late_run:failing_train",
        tracking_uri=mlflow_server.url, max_errors=1,
    )  # fmt: skip
    assert run_worker(cfg, spec, opts).outcomes == {"error": 1}
    trial = _study(journal, name).trials[0]
    assert trial.state == optuna.trial.TrialState.FAIL

    runs = _trial_runs(MlflowClient(mlflow_server.url), name)
    assert len(runs) == 1
    assert runs[0].info.run_id == trial.user_attrs["mlflow_run_id"]
    assert runs[0].info.status == "FAILED"
    assert "broken before its first epoch" in str(runs[0].data.tags)


def failing_train(config: Any, params: Any, report: Any, options: Any) -> Any:
    raise RuntimeError("broken before its first epoch")


def _new_study(tmp_path: Path, name: str) -> tuple[Any, StorageSpec, optuna.Study]:
    """The tiny study named `name`, and a new Optuna study of that name in a journal."""
    journal = tmp_path / "optuna.journal"
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))
    )
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    cfg = load_config("tiny", overrides=[f"name={name}"])
    return cfg, StorageSpec("journal", str(journal), "journal"), study


def test_a_dead_trial_without_a_run_gets_one_from_optuna(
    tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """What the launcher records for a trial whose worker died before its run was made."""
    from hpsearch.runs import open_study_run, record_dead_trial_run

    name = f"dead-{time.time_ns()}"
    cfg, spec, study = _new_study(tmp_path, name)
    trial = study.ask()
    trial.suggest_float("lr", 1e-3, 0.5, log=True)
    trial.set_user_attr("worker", "vm:w1")
    for epoch, value in ((1, 0.25), (2, 0.5)):
        trial.report(value, epoch)
    frozen = study.trials[0]
    assert (
        record_dead_trial_run(cfg, mlflow_server.url, frozen, "worker died") is None
    )  # no study run
    # A server that does not answer holds up the launcher's supervising loop for a moment,
    # not for MLflow's three 30 s tries of each call.
    t0 = time.monotonic()
    assert record_dead_trial_run(cfg, "http://127.0.0.1:9", frozen, "worker died") is None
    assert time.monotonic() - t0 < 5.0

    parent = open_study_run(cfg, spec, mlflow_server.url)
    run_id = record_dead_trial_run(cfg, mlflow_server.url, frozen, "worker died (signal 9)")
    assert run_id is not None
    client = MlflowClient(mlflow_server.url)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["optuna.trial_number"] == "0"
    assert run.data.tags["hpsearch.worker"] == "vm:w1"
    assert "worker died (signal 9)" in run.data.tags["hpsearch.reason"]
    assert float(run.data.params["lr"]) == frozen.params["lr"]
    history = client.get_metric_history(run_id, "val_acc")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert frozen.datetime_start is not None
    assert run.info.start_time == int(frozen.datetime_start.timestamp() * 1000)
    trial.set_user_attr("mlflow_run_id", run_id)  # as the launcher links it
    linked = study.trials[0]
    assert record_dead_trial_run(cfg, mlflow_server.url, linked, "again") is None  # it has one


def test_a_server_that_hangs_on_its_api_holds_the_launcher_for_a_bounded_time(
    tmp_path: Path,
) -> None:
    """A server that answers /health but hangs on every API call held the launcher's
    supervising loop for minutes per dead trial (each call up to 30 s x 3 tries)."""
    import threading

    from hpsearch.errors import TrackingError
    from hpsearch.runs import mark_run_failed_within, record_dead_trial_run_within
    from stack_util import fake_mlflow

    with fake_mlflow(200, hang=threading.Event()) as uri:
        cfg, _, study = _new_study(tmp_path, f"hang-{time.time_ns()}")
        trial = study.ask()
        trial.report(0.5, 1)
        t0 = time.monotonic()
        # given up with TrackingError: the launcher calls that server no more in this pass
        with pytest.raises(TrackingError, match="did not answer within 1 s"):
            record_dead_trial_run_within(cfg, uri, study.trials[0], "worker died", 1.0)
        trial.set_user_attr("mlflow_run_id", "0" * 32)
        with pytest.raises(TrackingError, match="ending its MLflow run"):
            mark_run_failed_within(uri, study.trials[0], "worker died", 1.0)
        assert time.monotonic() - t0 < 6.0  # two waits of 1 s, not minutes


def test_a_dead_trial_whose_run_was_made_gets_that_run_not_a_second(
    tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """The worker made the trial's run, then died before it linked it in Optuna: the
    launcher finds that run by the trial's run key and ends it, instead of making another."""
    from hpsearch.runs import open_study_run, record_dead_trial_run
    from hpsearch.tracking.mlflow_logger import TrialTracker, ensure_experiment

    name = f"dead-keyed-{time.time_ns()}"
    cfg, spec, study = _new_study(tmp_path, name)
    trial = study.ask()
    trial.suggest_float("lr", 1e-3, 0.5, log=True)
    key = "ab12" * 8
    trial.set_user_attr("mlflow_run_key", key)  # as the worker writes it, before the run
    parent = open_study_run(cfg, spec, mlflow_server.url)
    client = MlflowClient(mlflow_server.url)
    experiment_id = ensure_experiment(client, name)
    made = TrialTracker(
        client, experiment_id, parent, trial_number=0, study_name=name, params={"lr": 0.01},
        run_key=key,
    )  # fmt: skip
    made.log_epoch(1, {"val_acc": 0.3})
    made.flush(timeout_s=10.0)
    # ... and the worker is killed here: the run is RUNNING, and not linked.

    run_id = record_dead_trial_run(cfg, mlflow_server.url, study.trials[0], "worker died")
    assert run_id == made.run_id
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert "worker died" in run.data.tags["hpsearch.reason"]
    assert [m.value for m in client.get_metric_history(run_id, "val_acc")] == [0.3]
    trial_runs = client.search_runs([experiment_id], "tags.`hpsearch.role` = 'trial'")
    assert [r.info.run_id for r in trial_runs] == [run_id]
    # A retry starts with its failed try's attributes, the key included, until its worker
    # writes its own: it dies before that, and gets a run of its own, not the try's.
    retry = study.ask()
    retry.suggest_float("lr", 1e-3, 0.5, log=True)
    retry.set_user_attr("mlflow_run_key", key)
    own = record_dead_trial_run(cfg, mlflow_server.url, study.trials[1], "worker died")
    assert own is not None and own != run_id
    assert client.get_run(own).data.tags["optuna.trial_number"] == "1"


# Found at the tell, or at the next epoch's report (the branch a report still being
# written took by chance: the second trainer takes it every time).
@pytest.mark.parametrize(
    "train_fn", ["finished_elsewhere_meanwhile", "failed_elsewhere_then_reports"]
)
def test_a_trial_failed_elsewhere_before_its_tell_ends_its_run_failed(
    tmp_path: Path, mlflow_server: LocalServer, monkeypatch: pytest.MonkeyPatch, train_fn: str
) -> None:
    """Its worker cut off from the database, another worker's stale check failed the trial:
    the tell finds it finished elsewhere. Its run ended FINISHED, with its best model
    uploaded, beside a FAIL trial; it now ends FAILED, as its trial, and uploads none."""
    name = f"elsewhere-{time.time_ns()}"
    cfg = load_config(
        "tiny",
        overrides=[f"name={name}", "budget.n_trials=1", "budget.max_epochs=2",
                   "pruner.name=none", "pruner.options={}"],
    )  # fmt: skip
    journal = tmp_path / "optuna.journal"
    monkeypatch.setenv("HPSEARCH_DUMMY_JOURNAL", str(journal))
    spec = StorageSpec("journal", str(journal), "journal")
    opts = WorkerOptions(
        workdir=tmp_path, worker_id="w0", train_fn=f"dummy_trainer:{train_fn}",
        tracking_uri=mlflow_server.url, max_trials=1,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="finished elsewhere"):
        run_worker(cfg, spec, opts)
    trial = _study(journal, name).trials[0]
    assert trial.state == optuna.trial.TrialState.FAIL
    client = MlflowClient(mlflow_server.url)
    (run,) = _trial_runs(client, name)
    assert run.info.status == "FAILED"
    # Found at the tell ("finished elsewhere"), or by an epoch's report still being written
    # when the trial was failed (Optuna's "has already finished"): FAILED either way.
    assert "finished" in run.data.tags["hpsearch.reason"]
    assert not client.list_artifacts(run.info.run_id, "checkpoint")


def _one_tracked_trial(
    tmp_path: Path, server: LocalServer, prefix: str, train_fn: str
) -> tuple[str, Path, Any, StorageSpec, WorkerOptions]:
    """A one-trial study of its own name on a journal, and a worker's options to run it
    with `dummy_trainer.<train_fn>`, tracked on `server`."""
    name = f"{prefix}-{time.time_ns()}"
    cfg = load_config("tiny", overrides=[f"name={name}", "budget.n_trials=1"])
    journal = tmp_path / "optuna.journal"
    opts = WorkerOptions(
        workdir=tmp_path, worker_id="w0", train_fn=f"dummy_trainer:{train_fn}",
        tracking_uri=server.url, max_trials=1,
    )  # fmt: skip
    return name, journal, cfg, StorageSpec("journal", str(journal), "journal"), opts


def test_a_trial_told_pruned_for_want_of_a_value_ends_its_run_killed(
    tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """A time limit before the first evaluation: the trial is told PRUNED (no value), and
    its run ended FINISHED beside it."""
    name, journal, cfg, spec, opts = _one_tracked_trial(
        tmp_path, mlflow_server, "unvalued", "time_limit_before_eval"
    )
    run_worker(cfg, spec, opts)
    assert _study(journal, name).trials[0].state == optuna.trial.TrialState.PRUNED
    (run,) = _trial_runs(MlflowClient(mlflow_server.url), name)
    assert run.info.status == "KILLED"


def test_a_worker_stopped_by_a_database_outage_ends_its_trials_run(
    tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """The database down past the worker's limit stops the worker: its trial's run stayed
    RUNNING for good where no launcher ends it (a standalone worker's). It ends FAILED,
    with the epoch it logged."""
    from hpsearch.errors import StorageError

    name, _, cfg, spec, opts = _one_tracked_trial(
        tmp_path, mlflow_server, "outage", "database_gone_after_an_epoch"
    )
    with pytest.raises(StorageError, match="database unreachable"):
        run_worker(cfg, spec, opts)
    client = MlflowClient(mlflow_server.url)
    (run,) = _trial_runs(client, name)
    assert run.info.status == "FAILED"
    assert "its worker stopped: report: database unreachable" in str(run.data.tags)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")] == [1]


def test_an_interrupted_trials_last_checkpoint_is_uploaded_before_its_retry_is_queued(
    tmp_path: Path, mlflow_server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With uploads (several hosts), a stopped trial's retry was queued while its last
    checkpoint's upload was still in flight: a worker on another host took the retry and
    fetched the checkpoint before it, or none, and trained those epochs again."""
    import threading

    import hpsearch.runs as runs
    import hpsearch.worker as W

    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "0.3")  # s: the stop comes mid-trial
    stop = threading.Event()
    events: list[str] = []
    real_upload = runs._CheckpointUploader._upload
    real_requeue = W._fail_and_requeue

    def slow_upload(self: Any, path: Path) -> None:
        stop.set()  # the worker is told to stop during its first epoch's upload
        time.sleep(2.0)  # s: a large checkpoint on a slow link
        real_upload(self, path)
        events.append("uploaded")

    def requeue(*args: Any, **kwargs: Any) -> None:
        events.append("requeued")
        real_requeue(*args, **kwargs)

    monkeypatch.setattr(runs._CheckpointUploader, "_upload", slow_upload)
    monkeypatch.setattr(W, "_fail_and_requeue", requeue)
    name = f"upload-{time.time_ns()}"
    cfg = load_config(
        "tiny",
        overrides=[f"name={name}", "budget.n_trials=1", "budget.max_epochs=4",
                   "tracking.upload_checkpoints=true"],
    )  # fmt: skip
    journal = tmp_path / "optuna.journal"
    opts = WorkerOptions(
        workdir=tmp_path, worker_id="w0", train_fn="dummy_trainer:train",
        tracking_uri=mlflow_server.url, max_trials=1,
    )  # fmt: skip
    summary = run_worker(cfg, StorageSpec("journal", str(journal), "journal"), opts, stop)
    assert summary.outcomes == {"interrupted": 1}
    assert "uploaded" in events and events[-1] == "requeued", events  # none in flight
