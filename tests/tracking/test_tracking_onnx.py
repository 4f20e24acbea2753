"""The study's best model in ONNX: a worker holds the study best it told last and exports it
as it stops, only if that trial is still the study's best; the launcher's study artifacts
wait for that export. Real PostgreSQL, a real MLflow server, a real ResNet-18."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import hpsearch as hps
import numpy as np
import optuna
import pytest
import torch
import torchvision
from hpsearch.runs import ONNX_ARTIFACT, TrackingSession, _best_trial_onnx
from hpsearch.storage import normalize_url, resolve_storage
from hpsearch.study import suggest
from hpsearch.tracking.server import LocalServer
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow


def _best_model_file(folder: Path, seed: int) -> Path:
    """A best-model file as the trainer writes it (`_best_file`), in a snapshot folder as
    `checkpoint_uri` makes (`checkpoints/.upload-*/best.pt`)."""
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=102)
    snap = folder / "checkpoints" / f".upload-{seed}"
    snap.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "num_classes": 102}, snap / "best.pt")
    return snap / "best.pt"


def _onnx_files(client: MlflowClient, run_id: str) -> set[str]:
    return {a.path for a in client.list_artifacts(run_id, "model")}


def test_a_worker_exports_its_held_study_best_as_it_stops_and_only_if_still_the_best(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    cfg = hps.load_config("tiny", [f"name=onnx-{uuid.uuid4().hex[:8]}"])
    spec = resolve_storage(pg_url, tmp_path)
    study = optuna.create_study(
        storage=normalize_url(pg_url), study_name=cfg.name, direction="maximize"
    )
    client = MlflowClient(tracking_uri=mlflow_server.url)
    exp = client.create_experiment(cfg.name)

    def told(value: float) -> tuple[optuna.Trial, str]:
        trial = study.ask()
        suggest(trial, cfg)
        run_id = client.create_run(exp).info.run_id
        client.set_terminated(run_id)  # its run ends before the worker stops
        study.tell(trial, value)
        return trial, run_id

    # 1. Two new bests in a row: only the later one stays held; a better trial of another
    # worker then leaves nothing to export.
    session = TrackingSession(cfg, spec, mlflow_server.url, "w-a")
    first, first_run = told(0.5)
    first_file = _best_model_file(tmp_path, 1)
    session.hold_for_onnx(first, first_run, first_file)
    second, second_run = told(0.6)
    session.hold_for_onnx(second, second_run, _best_model_file(tmp_path, 2))
    held = list((tmp_path / "checkpoints").glob(".upload-*/best.pt"))
    assert len(held) == 3, held  # the two snapshots, and one hold (the first one's is gone)
    told(0.9)  # another worker's trial
    session.close()
    assert not _onnx_files(client, first_run) and not _onnx_files(client, second_run)

    # 2. Still the study's best when the worker stops: exported onto its run, and it runs.
    session = TrackingSession(cfg, spec, mlflow_server.url, "w-b")
    best, best_run = told(0.95)
    session.hold_for_onnx(best, best_run, _best_model_file(tmp_path, 3))
    assert not _onnx_files(client, best_run)  # nothing while trials go on
    session.close()
    assert _onnx_files(client, best_run) == {ONNX_ARTIFACT}
    import onnxruntime as ort

    path = client.download_artifacts(best_run, ONNX_ARTIFACT, str(tmp_path / "dl"))
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    (logits,) = sess.run(None, {sess.get_inputs()[0].name: x})
    assert logits.shape == (3, 102)
    # Every held snapshot is gone; the trainer's own snapshots are the finisher's to delete.
    left = sorted(p.parent.name for p in (tmp_path / "checkpoints").glob(".upload-*/*"))
    assert left == [".upload-1", ".upload-2", ".upload-3"]


def test_the_study_artifacts_wait_for_the_onnx_a_worker_exports_as_it_stops(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """The best trial's run has ended; its worker, still alive, logs the ONNX a little
    later (as it stops): `_best_trial_onnx` waits for it instead of returning None."""
    client = MlflowClient(tracking_uri=mlflow_server.url)
    run_id = client.create_run(client.create_experiment(f"late-onnx-{tmp_path.name}")).info.run_id
    client.set_terminated(run_id)
    study = optuna.create_study(storage=normalize_url(pg_url), direction="maximize")
    trial = study.ask()
    trial.set_user_attr("mlflow_run_id", run_id)
    study.tell(trial, 0.5)
    onnx = tmp_path / "best_model.onnx"
    onnx.write_bytes(b"onnx bytes")
    stopped = threading.Event()

    def worker_stops() -> None:
        time.sleep(1.5)
        client.log_artifact(run_id, str(onnx), "model")
        stopped.set()

    threading.Thread(target=worker_stops, daemon=True).start()
    t0 = time.monotonic()
    got = _best_trial_onnx(client, study, tmp_path / "out", wait_s=30.0,
                           workers_alive=lambda: not stopped.is_set())  # fmt: skip
    assert got is not None and got.read_bytes() == b"onnx bytes"
    assert 1.0 < time.monotonic() - t0 < 10.0
