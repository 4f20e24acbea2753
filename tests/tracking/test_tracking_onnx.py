"""The study's best model in ONNX: a worker holds the study best it told last and exports it
as it stops, only if that trial is still the study's best; the launcher's study artifacts
wait for that export. Real PostgreSQL, a real MLflow server, a real ResNet-18."""

from __future__ import annotations

import shutil
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
from hpsearch.runs import ONNX_ARTIFACT, TrackingSession, _best_trial_onnx, _export_best_onnx
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
    seeds = iter(range(100))

    def told(value: float) -> tuple[optuna.Trial, str]:
        trial = study.ask()
        suggest(trial, cfg)
        run_id = client.create_run(exp).info.run_id
        client.set_terminated(run_id)  # its run ends before the worker stops
        trial.set_user_attr("mlflow_run_id", run_id)
        study.tell(trial, value)
        return trial, run_id

    def hold(session: TrackingSession, trial: optuna.Trial, run_id: str, value: float) -> None:
        snap = _best_model_file(tmp_path, next(seeds))
        session.hold_for_onnx(trial, run_id, snap, value)
        shutil.rmtree(snap.parent)  # the run's finisher does, after its upload

    def held() -> list[Path]:
        return list((tmp_path / "checkpoints").glob(".upload-*/best.pt"))

    # 1. Two new bests in a row: only the later one stays held; a better trial of another
    # worker then leaves nothing to export.
    session = TrackingSession(cfg, spec, mlflow_server.url, "w-a")
    first, first_run = told(0.5)
    hold(session, first, first_run, 0.5)
    second, second_run = told(0.6)
    hold(session, second, second_run, 0.6)
    assert len(held()) == 1  # the first one's is gone
    told(0.9)  # another worker's trial
    session.close()
    assert not _onnx_files(client, first_run) and not _onnx_files(client, second_run)
    assert not held()

    # 2. A tie keeps the earlier trial held (Optuna's best_trial is the earlier of a tie);
    # still the study's best value when the worker stops: exported onto its run, and it runs.
    session = TrackingSession(cfg, spec, mlflow_server.url, "w-b")
    best, best_run = told(0.95)
    hold(session, best, best_run, 0.95)
    tie, tie_run = told(0.95)
    hold(session, tie, tie_run, 0.95)
    assert not _onnx_files(client, best_run)  # nothing while trials go on
    session.close()
    assert _onnx_files(client, best_run) == {ONNX_ARTIFACT} and not _onnx_files(client, tie_run)
    assert not held()
    import onnxruntime as ort

    path = client.download_artifacts(best_run, ONNX_ARTIFACT, str(tmp_path / "dl"))
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    (logits,) = sess.run(None, {sess.get_inputs()[0].name: x})
    assert logits.shape == (3, 102)
    # The study artifacts find it whichever of the tied trials the storage calls best.
    got = _best_trial_onnx(client, study, tmp_path / "out", wait_s=0.0)
    assert got is not None and got[1] == best.number
    assert got[0].read_bytes() == Path(path).read_bytes()


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
                           may_export=lambda worker: not stopped.is_set())  # fmt: skip
    assert got is not None and got[0].read_bytes() == b"onnx bytes" and got[1] == trial.number
    assert 1.0 < time.monotonic() - t0 < 10.0


def test_without_its_workers_export_the_launcher_exports_from_the_runs_checkpoint(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer
) -> None:
    """The best trial ran on another machine whose worker was killed before it stopped:
    no ONNX on its run and no best-model file here, but its run holds the top-k checkpoint."""
    cfg = hps.load_config("tiny", [f"name=onnx-{uuid.uuid4().hex[:8]}"])
    client = MlflowClient(tracking_uri=mlflow_server.url)
    run_id = client.create_run(client.create_experiment(cfg.name)).info.run_id
    client.log_artifact(run_id, str(_best_model_file(tmp_path, 7)), "checkpoint")
    study = optuna.create_study(storage=normalize_url(pg_url), direction="maximize")
    trial = study.ask()
    suggest(trial, cfg)
    trial.set_user_attr("mlflow_run_id", run_id)
    trial.set_user_attr("best_model", str(tmp_path / "elsewhere" / "trial-00000.best.pt"))
    study.tell(trial, 0.5)

    assert _best_trial_onnx(client, study, tmp_path / "a", wait_s=0.0) is None
    got = _export_best_onnx(cfg, study, tmp_path / "b", client)
    assert got is not None and got[0].stat().st_size > 1_000_000 and got[1] == trial.number
    assert _onnx_input_size(got[0]) == 32  # the tiny study's, the run saying nothing
    # The size its run says it was evaluated at (an earlier launch's eval_scale), not today's
    client.log_param(run_id, "eval_image_size", "40")
    got = _export_best_onnx(cfg, study, tmp_path / "b2", client)
    assert got is not None and _onnx_input_size(got[0]) == 40
    other = client.create_run(client.get_experiment_by_name(cfg.name).experiment_id)
    trial2 = study.ask()
    suggest(trial2, cfg)
    trial2.set_user_attr("mlflow_run_id", other.info.run_id)  # no checkpoint in this run
    study.tell(trial2, 0.9)
    assert _export_best_onnx(cfg, study, tmp_path / "c", client) is None


def _onnx_input_size(path: Path) -> int:
    import onnx

    dims = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim
    assert dims[2].dim_value == dims[3].dim_value
    return int(dims[2].dim_value)
