"""The study's artifacts at the end of a launch (`finalize_study`): each one on its own, so
one that cannot be written or sent costs that one only. Real PostgreSQL, a real MLflow
server, a real file-size limit (RLIMIT_FSIZE: writes past it fail with EFBIG)."""

from __future__ import annotations

import contextlib
import logging
import resource
import uuid
from collections.abc import Iterator
from pathlib import Path

import hpsearch as hps
import optuna
import pytest
from hpsearch.runs import ONNX_ARTIFACT, finalize_study, open_study_run
from hpsearch.storage import normalize_url, resolve_storage
from hpsearch.study import suggest
from hpsearch.tracking.artifacts import study_plots
from hpsearch.tracking.server import LocalServer
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow

LIMIT = 1 << 20  # bytes a file may grow to in the block below: a PNG fits, not plotly.js


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Files written by this process stop at `limit` bytes (OSError EFBIG; Python ignores
    SIGXFSZ). The MLflow server, another process, is not limited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_failed_study_artifact_costs_only_itself(
    pg_url: str, tmp_path: Path, mlflow_server: LocalServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Under a 1 MiB file-size limit the trials CSV (a 2 MiB user attribute) and the HTML
    plots (plotly.js embedded) cannot be written: the PNG plots and the best trial's ONNX
    are still logged on the study run."""
    cfg = hps.load_config("tiny", [f"name=artifacts-{uuid.uuid4().hex[:8]}"])
    spec = resolve_storage(pg_url, tmp_path)
    client = MlflowClient(tracking_uri=mlflow_server.url)
    parent = open_study_run(cfg, spec, mlflow_server.url)
    study = optuna.create_study(storage=normalize_url(pg_url), study_name=cfg.name,
                                direction="maximize")  # fmt: skip
    best_run = client.create_run(client.get_experiment_by_name(cfg.name).experiment_id)
    onnx = tmp_path / "best_model.onnx"
    onnx.write_bytes(b"onnx bytes")  # the worker's export, as it stops
    client.log_artifact(best_run.info.run_id, str(onnx), "model")
    for i, value in enumerate((0.3, 0.9, 0.5)):
        trial = study.ask()
        suggest(trial, cfg)
        if i == 0:
            trial.set_user_attr("notes", "x" * (2 * LIMIT))
        if value == 0.9:
            trial.set_user_attr("mlflow_run_id", best_run.info.run_id)
        study.tell(trial, value)

    caplog.set_level(logging.WARNING, logger="hpsearch.tracking")
    with file_size_limit(LIMIT):
        logged = finalize_study(cfg, spec, mlflow_server.url, study, tmp_path / "work")
    assert logged == ["plots", ONNX_ARTIFACT]
    assert "trials CSV failed" in caplog.text and ".html failed" in caplog.text
    files = {a.path for a in client.list_artifacts(parent)}
    assert "trials.csv" not in files and {"plots", "model"} <= files
    plots = {a.path for a in client.list_artifacts(parent, "plots")}
    assert "plots/optimization_history.png" in plots
    assert not any(p.endswith(".html") for p in plots)
    assert {a.path for a in client.list_artifacts(parent, "model")} == {ONNX_ARTIFACT}
    assert client.get_run(parent).data.tags["hpsearch.best_trial"] == "1"


def test_a_study_plot_that_cannot_be_written_leaves_the_others(tmp_path: Path) -> None:
    study = optuna.create_study(direction="maximize")
    study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0) + t.suggest_float("y", 0.0, 1.0),
                   n_trials=4)  # fmt: skip
    out = tmp_path / "plots"
    (out / "optimization_history.png").mkdir(parents=True)  # a folder in the file's place
    written = {p.name for p in study_plots(study, out, plotlyjs="cdn")}
    assert "optimization_history.png" not in written
    assert {"optimization_history.html", "param_importances.png"} <= written
