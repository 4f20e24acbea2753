"""The worker's MLflow run finisher: when queued run endings run; the snapshots of best
models that killed workers leave behind."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hpsearch.runs import _Finisher


def test_a_finished_runs_ending_waits_for_the_next_trial_to_train() -> None:
    done = threading.Event()
    f = _Finisher(hold_s=30)
    try:
        f.submit(done.set)
        assert not done.wait(0.5)  # the next trial's ask and start-up go first
        f.release()
        assert done.wait(5)
    finally:
        f.close()


def test_the_kept_runs_replay_holds_back_no_trials_ending() -> None:
    """The replay queued as the next trial starts, just after its `release` (its run's
    create answered late): the ending queued before it runs now, not after `hold_s`."""
    done, replayed = threading.Event(), threading.Event()
    f = _Finisher(hold_s=30)
    try:
        f.submit(done.set)
        f.release()
        f.submit(replayed.set, hold=False)
        assert done.wait(5) and replayed.wait(5)
    finally:
        f.close()


def test_close_runs_every_queued_ending_and_a_hold_has_a_limit() -> None:
    ran: list[int] = []
    f = _Finisher(hold_s=30)
    for i in range(3):
        f.submit(lambda i=i: ran.append(i))
    f.close()  # a stopping worker: nothing dropped, no 30 s wait
    assert ran == [0, 1, 2]

    done = threading.Event()
    g = _Finisher(hold_s=0.3)  # no next trial (e.g. waiting for GPU memory): not forever
    t0 = time.monotonic()
    g.submit(done.set)
    assert done.wait(5)
    assert time.monotonic() - t0 >= 0.25
    g.close()


def test_a_snapshot_is_abandoned_once_its_process_is_gone(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    from hpsearch.runs import _rmtree, _snapshot, remove_stale_snapshots, snapshot_abandoned

    study = tmp_path / "checkpoints" / "study"
    study.mkdir(parents=True)
    best = study / "trial-00003.best.pt"
    best.write_bytes(b"weights")
    mine = _snapshot(best)  # this process's, alive
    assert mine is not None and mine.read_bytes() == b"weights"
    code = (
        "import sys; from pathlib import Path; from hpsearch.runs import _snapshot; "
        "print(_snapshot(Path(sys.argv[1])).parent)"
    )  # a worker that dies holding its snapshot (no clean-up: the interpreter just ends)
    dead = subprocess.run([sys.executable, "-c", code, str(best)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    left = Path(dead.stdout.strip())
    assert left.parent == study and (left / best.name).read_bytes() == b"weights"
    unknown = study / ".upload-abcd1234"  # an older version's: no owner file
    unknown.mkdir()
    remote = study / ".upload-efgh5678"  # another machine's, on a shared work folder
    remote.mkdir()
    (remote / ".owner").write_text("another-host")  # unlocked here: its lock may be local
    host = socket.gethostname()
    assert snapshot_abandoned(left, host) and not snapshot_abandoned(mine.parent, host)
    assert not snapshot_abandoned(unknown, host) and not snapshot_abandoned(remote, host)

    assert remove_stale_snapshots(tmp_path / "checkpoints") == [left]
    assert not left.exists() and mine.exists() and best.exists()
    assert unknown.exists() and remote.exists()
    assert remove_stale_snapshots(tmp_path / "nothing-here") == []
    _rmtree(mine.parent)  # this process's own: deleted, and its lock released
    assert not mine.parent.exists()


def test_a_worker_may_still_export_a_trial_it_holds_a_model_of_while_it_lives() -> None:
    from hpsearch.runs import may_still_export

    alive = {101}.__contains__
    held = {"checkpoint_uri": "runs:/r/checkpoint/best.pt", "host": "box", "pid": 101}
    assert may_still_export(held, "box", alive)  # stops, then exports
    assert not may_still_export({**held, "pid": 102}, "box", alive)  # gone: it never will
    assert may_still_export({**held, "pid": 102}, "other", alive)  # another host's: unknown
    assert not may_still_export({**held, "checkpoint_uri": None}, "box", alive)  # none held


def test_a_forked_child_does_not_keep_the_parents_snapshots_locked(tmp_path: Path) -> None:
    """A DataLoader worker forked while a snapshot exists: its copy of the lock's descriptor
    is closed, so it cannot keep a dead parent's folder from being swept."""
    from hpsearch.runs import _owner_fds, _rmtree, _snapshot

    best = tmp_path / "trial-00001.best.pt"
    best.write_bytes(b"weights")
    snap = _snapshot(best)
    assert snap is not None and snap.parent in _owner_fds
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it still holds, and leave at once
        os.write(write, str(len(_owner_fds)).encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"0"
    os.waitpid(pid, 0)
    os.close(read)
    assert snap.parent in _owner_fds  # the parent's lock is still held
    _rmtree(snap.parent)


def test_an_unreadable_uploaded_checkpoint_is_not_resumed_from(tmp_path: Path) -> None:
    """A checkpoint cut short or damaged in MLflow was put in place when this host had none:
    the retry then failed at its load, ending the chain, where starting over would not."""
    from hpsearch.runs import TrackingSession

    class Client:
        def download_artifacts(self, run_id: str, folder: str, dst: str) -> str:
            out = Path(dst) / folder
            out.mkdir(parents=True)
            (out / "checkpoint.pt").write_bytes(b"garbage")
            return str(out)

    session = object.__new__(TrackingSession)
    session.wait_ready = lambda: None  # type: ignore[method-assign]
    session.client = Client()  # type: ignore[assignment]
    dest = tmp_path / "checkpoints" / "s" / "trial-00000.pt"
    assert not session.fetch_checkpoint("run", dest)
    assert not dest.exists() and [p.name for p in dest.parent.iterdir()] == []


def test_an_uploaded_checkpoint_is_never_newer_than_the_best_model_beside_it(
    tmp_path: Path,
) -> None:
    """The trainer wrote its next best model and checkpoint while the best model uploaded:
    the checkpoint copied after it was an epoch ahead of the best model in MLflow, and a
    retry elsewhere resumed past the best epoch without its weights."""
    from hpsearch.runs import _CheckpointUploader
    from hpsearch.trainer.types import best_model_path_for

    ckpt = tmp_path / "trial-00000.pt"
    best = best_model_path_for(ckpt)
    best.write_text("epoch 1")
    ckpt.write_text("epoch 1")
    sent: dict[str, str] = {}

    class Client:
        def log_artifact(self, run_id: str, local: str, folder: str) -> None:
            sent[Path(local).name] = Path(local).read_text()
            if len(sent) == 1:  # the trainer's next epoch lands during the first upload
                best.write_text("epoch 2")
                ckpt.write_text("epoch 2")

    uploader = _CheckpointUploader(Client(), "run")
    uploader.submit(ckpt)
    uploader.close()
    assert sent == {"checkpoint.best.pt": "epoch 1", "checkpoint.pt": "epoch 1"}


def test_each_mlflow_server_has_its_own_spool_folder(tmp_path: Path) -> None:
    """One folder kept the runs of every server: a launch on another server (or on the
    embedded one after a remote one) made them there, or set aside the runs it lacked."""
    from hpsearch.runs import EMBEDDED_SPOOL, SPOOL_FOLDER, spool_folder

    def folder(uri: str, embedded: bool = False) -> Path:
        return spool_folder(tmp_path, uri, embedded=embedded)

    remote = folder("https://mlflow.example.com/")
    assert remote.parent == tmp_path / SPOOL_FOLDER and remote.name != EMBEDDED_SPOOL
    assert folder("https://me:s3cret@MLflow.example.com") == remote  # a login, a spelling
    assert folder("https://mlflow.example.com:8443") != remote
    assert folder("https://mlflow.example.com/team-b") != remote
    assert folder("http://localhost:5000") == folder("http://127.0.0.1:5000/")  # one host
    assert folder("http://127.0.0.1:5000") != folder("http://127.0.0.1:5001")
    # The work folder's own server: one folder, whichever port a launch gave it.
    assert folder("http://127.0.0.1:5000", True) == folder("http://127.0.0.1:41234", True)
    assert folder("http://127.0.0.1:5000", True).name == EMBEDDED_SPOOL
    for odd in ("databricks", "http://h:notaport", "http://[::1"):
        assert folder(odd).parent == tmp_path / SPOOL_FOLDER


def test_a_run_made_after_its_trial_ended_is_linked_only_to_that_trial(tmp_path: Path) -> None:
    """Optuna takes no attribute on a finished trial: the run made for it later (it ended
    while MLflow was down) is linked by a study attribute, where the study of that name in
    this storage has that trial with the kept record's run key."""
    import optuna
    from hpsearch.runs import link_late_run
    from hpsearch.storage import StorageSpec, open_storage

    journal = tmp_path / "optuna.journal"
    storage = open_storage(StorageSpec("journal", str(journal), "journal"))
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask()
    trial.set_user_attr("mlflow_run_key", "k1")
    study.tell(trial, 1.0)
    create = {"experiment": "s", "trial_number": 0, "run_key": "k1"}
    assert link_late_run(storage, create, "r1")
    assert study.user_attrs == {"mlflow_run_id.0": "r1"}
    # Another storage's study of that name, or another try of that trial: not linked.
    assert not link_late_run(storage, {**create, "run_key": "k2"}, "r2")
    assert not link_late_run(storage, {**create, "trial_number": 5}, "r3")
    assert not link_late_run(storage, {**create, "experiment": "other"}, "r4")
    assert not link_late_run(storage, {**create, "run_key": None}, "r5")
    assert study.user_attrs == {"mlflow_run_id.0": "r1"}


def test_a_retrys_earlier_run_is_the_one_linked_else_the_one_made_after_it_ended(
    pg_url: str,
) -> None:
    """The failed try's run, for the retry's copy of the epochs before its resume: the
    one the try linked (copied to the retry), else the one made for it after it ended (a
    run kept offline and sent later), which only the study's attributes name."""
    import uuid

    import optuna
    from hpsearch.worker import earlier_run
    from optuna.trial import TrialState, create_trial

    study = optuna.create_study(study_name=f"earlier-{uuid.uuid4().hex[:8]}", storage=pg_url)
    study.add_trial(create_trial(state=TrialState.WAITING, system_attrs={"failed_trial": 3}))
    trial = study.ask()

    def db(fn: object, what: str) -> object:
        return fn()  # type: ignore[operator]

    assert earlier_run(study, trial, "linked", db) == "linked"
    assert earlier_run(study, trial, "", db) is None
    study.set_user_attr("mlflow_run_id.3", "made-later")
    assert earlier_run(study, trial, "", db) == "made-later"
    first = study.ask()  # no retry: no failed try
    assert earlier_run(study, first, None, db) is None
    # A retry of a retry: the try just before (its retry_history's last), not the first.
    study.add_trial(create_trial(state=TrialState.WAITING,
                                 system_attrs={"failed_trial": 3, "retry_history": [3, 7]}))  # fmt: skip
    second = study.ask()
    assert earlier_run(study, second, "", db) is None
    study.set_user_attr("mlflow_run_id.7", "the-one-before")
    assert earlier_run(study, second, "", db) == "the-one-before"


def test_a_missing_best_model_says_whether_the_store_its_run_or_its_file_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA: a run whose best.pt was deleted was said to be in no MLflow store of the work
    folder, which held it."""
    import optuna
    from hpsearch.errors import HpsearchError
    from hpsearch.runs import download_best_model
    from hpsearch.tracking.server import store_paths

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_id = "03a9ba0e0e564b4da1a7af16a4e90eb0"
    trial = optuna.trial.create_trial(
        value=0.5,
        user_attrs={
            "mlflow_run_id": run_id,
            "checkpoint_uri": f"runs:/{run_id}/checkpoint/best.pt",
        },
    )
    with pytest.raises(HpsearchError, match=r"holds no MLflow store \(workdir= names"):
        download_best_model(trial, None, tmp_path, tmp_path / "dl")
    _, artifacts, _ = store_paths(tmp_path)
    (artifacts / "1" / "other").mkdir(parents=True)
    with pytest.raises(HpsearchError, match=r"has no run of it"):
        download_best_model(trial, None, tmp_path, tmp_path / "dl")
    (artifacts / "1" / run_id / "artifacts" / "checkpoint").mkdir(parents=True)
    with pytest.raises(HpsearchError, match=r"has no checkpoint/best.pt any more"):
        download_best_model(trial, None, tmp_path, tmp_path / "dl")
    (artifacts / "1" / run_id / "artifacts" / "checkpoint" / "best.pt").write_bytes(b"w")
    assert download_best_model(trial, None, tmp_path, tmp_path / "dl").read_bytes() == b"w"


def test_summary_metrics_from_a_trials_stored_epochs() -> None:
    from hpsearch.runs import summary_from_history

    history = [
        {"epoch": 1, "val_acc": 0.2, "val_loss": 3.0, "epoch_seconds": 1.0},
        {"epoch": 2, "val_acc": None, "val_loss": None, "epoch_seconds": 1.5},  # not evaluated
        {"epoch": 3, "val_acc": 0.4, "val_loss": float("inf"), "epoch_seconds": 2.0},
        {"epoch": 4, "val_acc": 0.4, "val_loss": 2.0, "epoch_seconds": 2.0},
    ]
    assert summary_from_history(history, "val_acc", 0.35) == {
        "train_seconds": 6.5,
        "best_val_acc": 0.4,
        "test_acc": 0.35,
    }  # the first of the tied best epochs: its val_loss is not finite, so none
    assert summary_from_history(history, "val_loss") == {
        "train_seconds": 6.5,
        "best_val_acc": 0.4,
        "best_val_loss": 2.0,
    }
    assert summary_from_history([], "val_acc", None) == {}
    # A study known by its metric names alone: a multi-objective val_loss study's best
    # epoch is by val_loss too (review), as StudyConfig.reported_metric has it.
    from hpsearch.config import reported_metric_of

    assert reported_metric_of(["val_loss", "train_seconds"]) == "val_loss"
    assert reported_metric_of(["val_acc", "val_loss"]) == "val_acc"
    assert reported_metric_of(None) == "val_acc"


def test_a_custom_trainers_epoch_record_of_no_number_never_fails_its_trial() -> None:
    """`lr=scheduler.get_last_lr()` (a list) raised TypeError into training from the
    metrics' conversion; the tracker drops what is no number, with a warning."""
    from types import SimpleNamespace

    from hpsearch.runs import TrialRun
    from hpsearch.tracking.mlflow_logger import metric_entities

    got: list[Any] = []

    class Tracker:
        def log_epoch(self, step: int, metrics: Any, timestamp_ms: Any = None) -> None:
            got.append(metric_entities(metrics, step, 0))

        def copy_history(self, *a: Any) -> None:
            raise AssertionError("no earlier epochs")

    run = TrialRun.__new__(TrialRun)
    run.tracker, run.sampler, run._earlier = Tracker(), None, None
    run.trial = SimpleNamespace(number=0)
    record = SimpleNamespace(epoch=1, train_loss=0.5, train_acc=0.8, val_loss=0.4,
                             val_acc=0.9, lr=[0.1, 0.01], epoch_seconds=3.0,
                             images_per_second=100.0)  # fmt: skip
    run.log_epoch(record)
    (metrics, dropped) = got[0]
    assert dropped == ["lr"] and {m.key for m in metrics} >= {"val_acc", "train_loss"}
    run.log_epoch(SimpleNamespace(epoch="one"))  # no step at all: warned, not raised
