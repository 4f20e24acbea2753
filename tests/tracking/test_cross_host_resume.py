"""Resume on another machine through MLflow (tracking.upload_checkpoints): a trial stopped in
one work folder is resumed in another that has none of its files, from the checkpoint its
run uploaded; and a run that a killed worker left RUNNING, which the end of a launch must
not wait for. Real PostgreSQL, a real MLflow server, the fast dummy trainer."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import hpsearch as hps
import pytest
from cli_util import DUMMY, hpsearch
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
