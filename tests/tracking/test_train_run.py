"""`hpsearch train`'s MLflow run (hpsearch.runs.FixedRun): beside the study's trials in its
experiment, with a trial run's params, epochs, plots and best model. Real Flowers-102, real
MLflow servers (the work folder's embedded one, and the session's)."""

from __future__ import annotations

import types
import uuid
from pathlib import Path

import pytest
from cli_util import hpsearch
from hpsearch import load_study
from hpsearch.tracking.server import LocalServer, running_server_url, start_local_server
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow


def test_a_train_run_is_an_mlflow_run_beside_the_trials_each_time_it_runs(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """`hpsearch train` logged nothing to MLflow and its next run overwrote its best model:
    a run reproduced by hand could not be compared with the trial it reproduced. Now each
    run is a run of the study's experiment, on the work folder's embedded server (started
    and stopped for it when none runs), its best model kept there."""
    work = tmp_path / "w"
    name = f"train-{uuid.uuid4().hex[:8]}"
    args = ["train", "--study", "tiny", "--set", f"name={name}", "--workdir", str(work),
            "--device", "cpu"]  # fmt: skip
    runs = []
    # The second trains on 40 images: a batch of the split, not of 64 (QA: MLflow said 64).
    for lr, epochs, limit in ((0.05, 2, "null"), (0.02, 1, "40")):
        # focal_gamma: unread under the default loss (warned of), so not logged (QA)
        params = f'{{"lr": {lr}, "batch_size": 64, "focal_gamma": 2.5}}'
        out = hpsearch([*args, "--set", f"budget.max_epochs={epochs}", "--params", params,
                        "--set", f"dataset.train_limit={limit}"], subprocess_env)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        made = [ln for ln in out.stdout.splitlines() if ln.startswith("MLflow run ")]
        assert len(made) == 1, out.stdout
        runs.append(made[0].split()[2])
        assert running_server_url(work) is None  # stopped: it was this run's alone
    server = start_local_server(work)  # as `hpsearch ui` shows them
    try:
        _check_train_runs(MlflowClient(tracking_uri=server.url), name, runs)
    finally:
        server.stop()

    out = hpsearch([*args, "--no-tracking", "--tracking-uri", "http://127.0.0.1:1"],
                   subprocess_env)  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.strip() == "Error: --no-tracking and --tracking-uri: give one of them"


def _check_train_runs(client: MlflowClient, name: str, runs: list[str]) -> None:
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    found = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time"])
    assert [r.info.run_id for r in found] == runs
    for run, lr, epochs in zip(found, ("0.05", "0.02"), ([1, 2], [1]), strict=True):
        assert run.info.status == "FINISHED"
        assert run.info.run_name == "train-fixed"
        tags = run.data.tags
        assert tags["hpsearch.role"] == "train" and tags["hpsearch.gpu"] == "none"
        assert "mlflow.parentRunId" not in tags and "optuna.trial_number" not in tags
        params = run.data.params
        assert (params["lr"], params["batch_size"], params["arch"]) == (lr, "64", "resnet18")
        assert params["image_size"] == "32" and params["effective_lr"] == lr
        assert params["effective_batch_size"] == ("64" if epochs == [1, 2] else "40")
        assert params["loss"] == "ce"  # searched, not given: trained at the default
        assert "focal_gamma" not in params  # unread under the default loss, as in a trial's
        history = client.get_metric_history(run.info.run_id, "val_acc")
        assert [m.step for m in history] == epochs
        assert run.data.metrics["best_val_acc"] == max(m.value for m in history)
        losses = client.get_metric_history(run.info.run_id, "val_loss")
        assert run.data.metrics["best_val_loss"] in [m.value for m in losses]
        files = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"checkpoint", "learning_curve.png", "confusion_matrix.png"} <= files
        (best,) = client.list_artifacts(run.info.run_id, "checkpoint")
        assert best.path == "checkpoint/best.pt" and (best.file_size or 0) > 1_000_000


def test_a_train_run_that_fails_is_a_failed_run_with_its_error(
    tmp_path: Path, mlflow_server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that fails ends FAILED with its one-line reason and traceback; one whose server
    does not answer is refused in one line before any training."""
    from hpsearch import trainer
    from hpsearch.config import load_config
    from hpsearch.errors import HpsearchError, TrackingError
    from hpsearch.runner import run_fixed

    name = f"train-{uuid.uuid4().hex[:8]}"
    cfg = load_config("tiny", [f"name={name}"])
    epochs = []

    def fails_after_an_epoch(cfg: object, params: object, report: object, options: object) -> None:
        record = types.SimpleNamespace(
            epoch=1, train_loss=2.5, train_acc=0.1, val_acc=0.2, val_loss=2.4, lr=0.05,
            epoch_seconds=1.0, images_per_second=100.0,
        )  # fmt: skip
        options.on_epoch(record)  # type: ignore[attr-defined]
        epochs.append(1)
        raise RuntimeError("test split: out of memory")

    monkeypatch.setattr(trainer, "train", fails_after_an_epoch)
    made: list[str] = []
    with pytest.raises(HpsearchError, match=r"training failed: RuntimeError: .* out of memory"):
        run_fixed(cfg, '{"lr": 0.05}', None, None, tmp_path, "cpu", None,
                  tracking_uri=mlflow_server.url, on_run=made.append)  # fmt: skip
    assert epochs == [1]
    client = MlflowClient(tracking_uri=mlflow_server.url)
    run = client.get_run(made[0])
    assert run.info.status == "FAILED"
    assert run.data.tags["hpsearch.reason"] == "RuntimeError: test split: out of memory"
    assert [m.value for m in client.get_metric_history(made[0], "val_acc")] == [0.2]
    assert "traceback.txt" in {a.path for a in client.list_artifacts(made[0])}

    def never_called(*args: object) -> None:
        raise AssertionError("trained without a run")

    monkeypatch.setattr(trainer, "train", never_called)
    with pytest.raises(TrackingError, match=r"^MLflow: cannot get or create experiment"):
        run_fixed(cfg, '{"lr": 0.05}', None, None, tmp_path, "cpu", None,
                  tracking_uri="http://127.0.0.1:9")  # fmt: skip
    assert not (tmp_path / "train").exists()


def test_a_train_run_stopped_by_a_hang_up_ends_killed_and_stops_its_server(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Review: SIGTERM or a closed terminal (SIGHUP, which comes twice: the kernel's and the
    shell's) left the server `train` started running with no live user, and its run
    RUNNING for good. Now the epoch ends and the run with it, KILLED, as on Ctrl-C. A run
    of `--trial N` says which trial it reproduces, and of which study (its uid). A missing dataset starts no server and
    makes no run."""
    import signal

    from cli_util import DUMMY

    work = tmp_path / "w"
    out = hpsearch(["launch", "--study", "tiny", "--trials", "1", "--workdir", str(work),
                    "--train-fn", DUMMY, "--no-tracking"], subprocess_env)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    args = ["train", "--study", "tiny", "--trial", "0", "--set", "budget.max_epochs=4",
            "--workdir", str(work), "--device", "cpu"]  # fmt: skip
    missing = hpsearch([*args, "--data-dir", str(tmp_path / "none")], subprocess_env)
    assert missing.returncode == 65, missing.stdout + missing.stderr
    assert "MLflow" not in missing.stdout and not (work / "mlflow").exists()

    # Two SIGHUPs 5 ms apart: the same hang-up, not a second stop.
    rc, lines = _signalled(args, subprocess_env, [(signal.SIGHUP, 0.005), (signal.SIGHUP, 0)])
    shown = "".join(lines)
    assert rc == 128 + signal.SIGHUP, shown
    assert "train: stopping after the current epoch" in shown, shown
    assert "interrupted: best_val_acc" in shown and "killing now" not in shown, shown
    assert running_server_url(work) is None, shown  # it was this run's: stopped
    hung_up = next(ln.split()[2] for ln in lines if ln.startswith("MLflow run "))

    # QA: a second Ctrl-C killed it at once (the "again" went to the handler a third
    # time): the run stayed RUNNING and the earlier run's best model was lost.
    best = work / "train" / "tiny" / "trial-0.best.pt"
    earlier = best.read_bytes()
    rc, lines = _signalled(args, subprocess_env, [(signal.SIGINT, 0.5), (signal.SIGINT, 0)])
    again = "".join(lines)
    assert rc == 130 and "exiting" not in again, again
    assert best.read_bytes() == earlier, again  # the earlier run's, back in place
    assert running_server_url(work) is None, again
    twice = next(ln.split()[2] for ln in lines if ln.startswith("MLflow run "))
    server = start_local_server(work)  # (one start for both runs' checks: seconds each)
    try:
        client = MlflowClient(tracking_uri=server.url)
        run = client.get_run(hung_up)
        assert run.info.status == "KILLED" and run.info.run_name == "train-trial-0"
        assert run.data.tags["hpsearch.reproduces_trial"] == "0"
        # Of which study of the name: its uid, as the study's own runs carry it.
        uid = load_study("tiny", workdir=work).user_attrs["hpsearch.study_uid"]
        assert run.data.tags["hpsearch.study_uid"] == uid and uid
        assert run.data.tags["hpsearch.outcome"] == "interrupted"
        steps = [m.step for m in client.get_metric_history(hung_up, "val_acc")]
        assert steps in ([1], [1, 2]), steps  # the epoch it was in when the signal came
        run = client.get_run(twice)
        assert run.info.status == "KILLED", (run.info.status, again)
    finally:
        server.stop()


def _signalled(
    args: list[str], env: dict[str, str], signals: list[tuple[int, float]]
) -> tuple[int, list[str]]:
    """Run `hpsearch ARGS`; once it prints epoch 1, send each signal, then wait so many
    seconds. Its exit code and every line it printed."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "hpsearch.cli", *args], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("epoch 1:"):
                for signum, pause in signals:
                    proc.send_signal(signum)
                    time.sleep(pause)
                break
        rest, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    return proc.returncode, [*lines, *rest.splitlines(keepends=True)]
