"""Resume on another machine through MLflow (tracking.upload_checkpoints): a trial stopped in
one work folder is resumed in another that has none of its files, from the checkpoint its
run uploaded; and a run that a killed worker left RUNNING, which the end of a launch must
not wait for. Real PostgreSQL, a real MLflow server, the fast dummy trainer."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import hpsearch as hps
import pytest
import torch
from cli_util import DUMMY, hpsearch
from hpsearch.config import StudyConfig, validate_config
from hpsearch.tracking.server import LocalServer
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

pytestmark = pytest.mark.slow


def test_stopped_trial_resumes_elsewhere_from_its_uploaded_checkpoint(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str], mlflow_server: LocalServer
) -> None:
    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "0.5"}
    name = "tiny-xhost"

    def args(workdir: Path) -> list[str]:
        return ["launch", "--study", "tiny", "--workers", "1", "--trials", "1",
                "--storage", pg_url, "--tracking-uri", mlflow_server.url,
                "--workdir", str(workdir), "--train-fn", DUMMY,
                "--set", f"name={name}", "--set", "budget.max_epochs=12",
                "--set", "pruner.name=none", "--set", "pruner.options={}",
                "--set", "tracking.upload_checkpoints=true"]  # fmt: skip

    first = subprocess.Popen(
        [sys.executable, "-m", "hpsearch.cli", *args(tmp_path / "host-a")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                trials = hps.load_study(name, storage=pg_url).get_trials()
            except hps.HpsearchError:  # not created yet
                trials = []
            if any(len(t.intermediate_values) >= 3 for t in trials):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the trial never got 3 epochs in")
        assert first.poll() is None
        first.send_signal(signal.SIGINT)
        out, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 130, out
    trials = hps.load_study(name, storage=pg_url).get_trials()
    [stopped] = [t for t in trials if t.state == TrialState.FAIL]
    last = max(stopped.intermediate_values)
    assert 3 <= last < 12  # 12: the stop lands with 4.5 s to spare on a loaded machine

    # The run holds the stop's own save (the last epoch), not an earlier one.
    client = MlflowClient(tracking_uri=mlflow_server.url)
    local = client.download_artifacts(
        stopped.user_attrs["mlflow_run_id"], "resume/checkpoint.pt", str(tmp_path / "dl")
    )
    assert json.loads(Path(local).read_text())["epoch"] == last

    # Another machine: a fresh work folder, no checkpoint on disk.
    r = hpsearch(args(tmp_path / "host-b"), env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    trials = hps.load_study(name, storage=pg_url).get_trials()
    [retry] = [t for t in trials if t.system_attrs.get("failed_trial") == stopped.number]
    assert retry.state == TrialState.COMPLETE
    assert retry.user_attrs["resumed_from_epoch"] == last + 1
    assert max(retry.intermediate_values) == 12

    # The retry's run charts the whole trial: epochs 1 to `last` as its failed try's run
    # has them (the checkpoint's), then its own; each epoch once.
    run_id = retry.user_attrs["mlflow_run_id"]
    mine = {m.step: m.value for m in client.get_metric_history(run_id, "val_acc")}
    before = {
        m.step: m.value
        for m in client.get_metric_history(stopped.user_attrs["mlflow_run_id"], "val_acc")
    }
    assert len(client.get_metric_history(run_id, "val_acc")) == 12
    assert sorted(mine) == list(range(1, 13))
    assert all(mine[e] == before[e] for e in range(1, last + 1))
    assert (
        client.get_run(run_id).data.tags["hpsearch.history_from_run"]
        == stopped.user_attrs["mlflow_run_id"]
    )


def test_best_trial_onnx_does_not_wait_for_a_run_whose_worker_is_gone(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """A best trial's run left RUNNING by a killed worker never finishes: the launcher's
    study artifacts wait for its ONNX only while its worker may still log it (then export
    ONNX themselves)."""
    import optuna
    from hpsearch.runs import _best_trial_onnx
    from hpsearch.storage import normalize_url

    client = MlflowClient(tracking_uri=mlflow_server.url)
    exp = client.create_experiment(f"orphan-{tmp_path.name}")
    run = client.create_run(exp)  # RUNNING, and stays so: no one will end it
    study = optuna.create_study(storage=normalize_url(pg_url), direction="maximize")
    trial = study.ask()
    trial.set_user_attr("mlflow_run_id", run.info.run_id)
    study.tell(trial, 0.5)

    t0 = time.monotonic()
    got = _best_trial_onnx(client, study, tmp_path, wait_s=30.0, may_export=lambda w: False)
    assert got is None and time.monotonic() - t0 < 10.0
    alive = iter([True, True, False])  # a worker finishing for a while, then gone
    t0 = time.monotonic()
    got = _best_trial_onnx(client, study, tmp_path, wait_s=30.0, may_export=lambda w: next(alive))
    assert got is None and 0.9 < time.monotonic() - t0 < 10.0


TINY = {"batch_size": 16, "lr": 0.05, "arch": "resnet18"}


def _synthetic(name: str, max_epochs: int) -> StudyConfig:
    """16 px synthetic images (48 train, 32 val and test), evaluated every 2nd epoch (and at
    the last), resume checkpoints uploaded to MLflow."""
    dataset = {"name": "synthetic", "image_size": 16, "train_limit": 48, "eval_limit": 32}
    return validate_config({
        "name": name, "dataset": dataset, "budget": {"max_epochs": max_epochs},
        "trainer": {"eval_every": 2, "evaluate_test": True},
        "tracking": {"upload_checkpoints": True},
    })  # fmt: skip


def test_a_retry_elsewhere_gets_the_best_model_and_its_own_run_holds_both_at_once(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host A trains epochs 1-3 with the real trainer and is stopped: its best model is epoch
    2's (epoch 3 is not evaluated), kept in `trial-00000.best.pt`, which the resume checkpoint
    leaves out. Host B's retry fetches both from A's run, and its own run holds them before
    it trains an epoch; B dies in set-up, and host C's retry fetches both from B's run. Its
    budget (3 epochs) is spent, so its test accuracy is the best model's."""
    import optuna
    from hpsearch.runs import TrackingSession
    from hpsearch.storage import normalize_url, resolve_storage
    from hpsearch.trainer import TrainOptions, evaluate_model, load_trained_model, train
    from hpsearch.trainer.trial import best_model_path_for

    name = f"xhost-best-{uuid.uuid4().hex[:8]}"
    cfg = _synthetic(name, max_epochs=4)
    spec = resolve_storage(pg_url, tmp_path)
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=name,
                                direction="maximize")  # fmt: skip
    client = MlflowClient(tracking_uri=mlflow_server.url)

    # Host A: stopped after epoch 3, as a worker whose machine goes away.
    host_a = TrackingSession(cfg, spec, mlflow_server.url, "w-a")
    ckpt_a = tmp_path / "host-a" / "trial-00000.pt"
    trial = study.ask()
    run_a = host_a.start_trial(trial, TINY, trial.number, ckpt_a)
    assert run_a is not None and run_a.run_id
    epochs: list[int] = []
    stopped = train(cfg, TINY, lambda e, v: False, TrainOptions(
        device="cpu", workdir=tmp_path / "host-a", checkpoint_path=ckpt_a,
        on_epoch=lambda r: epochs.append(r.epoch), on_checkpoint=run_a.checkpoint_written,
        should_interrupt=lambda: len(epochs) >= 3,
    ))  # fmt: skip
    assert stopped.stop_reason == "interrupted" and stopped.best_val_acc is not None
    best_a = best_model_path_for(ckpt_a)
    assert torch.load(ckpt_a, weights_only=False)["epoch"] == 3
    assert "best_state" not in torch.load(ckpt_a, weights_only=False)["run"]
    assert torch.load(best_a, weights_only=False)["epoch"] == 2
    run_a.finish_result(stopped)
    host_a.close()  # its uploads are done
    resume = {a.path for a in client.list_artifacts(run_a.run_id, "resume")}
    assert resume == {"resume/checkpoint.pt", "resume/checkpoint.best.pt"}

    # Host B: the retry fetches both, downloading beside the checkpoint (not in /tmp, which
    # may not hold 100 MB), and leaving nothing else there.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-tmp-here"))
    host_b = TrackingSession(cfg, spec, mlflow_server.url, "w-b")
    ckpt_b = tmp_path / "host-b" / "trial-00000.pt"
    assert host_b.fetch_checkpoint(run_a.run_id, ckpt_b)
    monkeypatch.undo()
    assert ckpt_b.read_bytes() == ckpt_a.read_bytes()
    assert best_model_path_for(ckpt_b).read_bytes() == best_a.read_bytes()
    assert sorted(p.name for p in ckpt_b.parent.iterdir()) == [
        "trial-00000.best.pt", "trial-00000.pt"
    ]  # fmt: skip
    retry = study.ask()
    run_b = host_b.start_trial(retry, TINY, trial.number, ckpt_b)
    assert run_b is not None and run_b.run_id
    run_b.finish_failed("error", "died in set-up", None)  # before any epoch of its own
    host_b.close()
    resume = {a.path for a in client.list_artifacts(run_b.run_id, "resume")}
    assert resume == {"resume/checkpoint.pt", "resume/checkpoint.best.pt"}

    # Host C: from B's run; nothing left to train in a 3-epoch budget: the test pass must
    # take the best model (epoch 2), not the last weights (epoch 3).
    host_c = TrackingSession(cfg, spec, mlflow_server.url, "w-c")
    ckpt_c = tmp_path / "host-c" / "trial-00000.pt"
    assert host_c.fetch_checkpoint(run_b.run_id, ckpt_c)
    # A file of this host's as far along stays (fetched again: nothing replaced); one an
    # earlier try of this host left, epochs behind the upload, is replaced.
    assert not host_c.fetch_checkpoint(run_b.run_id, ckpt_c)
    ckpt_d = tmp_path / "host-c-again" / "trial-00000.pt"
    ckpt_d.parent.mkdir()
    torch.save({"epoch": 1}, ckpt_d)
    assert host_c.fetch_checkpoint(run_b.run_id, ckpt_d)
    assert torch.load(ckpt_d, weights_only=False)["epoch"] == 3
    ahead = {**torch.load(ckpt_d, weights_only=False), "epoch": 7}
    torch.save(ahead, ckpt_d)
    assert not host_c.fetch_checkpoint(run_b.run_id, ckpt_d)
    assert torch.load(ckpt_d, weights_only=False)["epoch"] == 7
    host_c.close()
    assert best_model_path_for(ckpt_c).read_bytes() == best_a.read_bytes()
    spent = _synthetic(name, max_epochs=3)
    resumed = train(spent, TINY, lambda e, v: False, TrainOptions(
        device="cpu", workdir=tmp_path / "host-c", checkpoint_path=ckpt_c))  # fmt: skip
    assert resumed.stop_reason == "finished" and resumed.best_val_acc == stopped.best_val_acc
    assert resumed.best_model_path == best_model_path_for(ckpt_c)
    model = load_trained_model(spent, TINY, best_a)
    expected, _ = evaluate_model(spent, TINY, model, "test", tmp_path / "eval")
    assert resumed.test_acc == expected
