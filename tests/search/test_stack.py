"""The team stack without Docker: PostgreSQL for Optuna and for MLflow, a real ``mlflow server``
proxying artifacts, and two ``hpsearch worker`` processes with their own work folders standing
for two hosts, training the real trainer on real Flowers-102."""

from __future__ import annotations

import socket
import urllib.request

import optuna
import pytest
import sqlalchemy as sa
from stack_util import (
    WORKERS,
    StackStudy,
    experiment_by_name,
    list_artifacts,
    search_runs,
    tags_of,
)

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"


def _logs(stack: StackStudy) -> str:
    return "\n".join(f"--- {w} (rc {stack.returncodes.get(w)}):\n{stack.log_text(w)[-3000:]}"
                     for w in WORKERS)  # fmt: skip


def _files(run_id: str, stack: StackStudy, path: str = "") -> set[str]:
    """Every artifact path of a run, recursively, as the server lists them."""
    out: set[str] = set()
    for f in list_artifacts(stack.url, run_id, path):
        if f.get("is_dir"):
            out |= _files(run_id, stack, f["path"])
        else:
            out.add(f["path"])
    return out


def test_two_workers_finish_the_study(stack: StackStudy) -> None:
    assert stack.returncodes == dict.fromkeys(WORKERS, 0), _logs(stack)
    study = optuna.load_study(study_name=stack.study, storage=stack.storage)
    trials = study.get_trials(deepcopy=False)
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    assert len(trials) == stack.n_trials, _logs(stack)
    assert all(t.state in finished for t in trials), [(t.number, t.state) for t in trials]
    assert any(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    by_worker = {str(t.user_attrs.get("worker")) for t in trials}
    assert by_worker == set(WORKERS), [t.user_attrs for t in trials]
    for w in WORKERS:
        assert "trials" in stack.log_text(w) and f"worker {w}:" in stack.log_text(w)


def test_runs_are_in_the_postgresql_backed_server(stack: StackStudy) -> None:
    exp = experiment_by_name(stack.url, stack.study)
    runs = search_runs(stack.url, exp["experiment_id"])
    roles = [tags_of(r).get("hpsearch.role") for r in runs]
    assert sorted(roles, key=str) == sorted(["study"] + ["trial"] * stack.n_trials, key=str)
    # The server really stores them in its PostgreSQL database, not in a file store. (Two
    # workers that start together may both open a study run; the newer one is deleted.)
    eng = sa.create_engine(stack.mlflow_db, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as c:
            active = c.execute(
                sa.text("SELECT run_uuid FROM runs WHERE experiment_id = :e"
                        " AND lifecycle_stage = 'active'"),
                {"e": int(exp["experiment_id"])},
            ).scalars().all()  # fmt: skip
    finally:
        eng.dispose()
    assert sorted(active) == sorted(r["info"]["run_id"] for r in runs)
    # Optuna trials point at these runs.
    study = optuna.load_study(study_name=stack.study, storage=stack.storage)
    trial_runs = {r["info"]["run_id"] for r in runs if tags_of(r).get("hpsearch.role") == "trial"}
    assert {t.user_attrs.get("mlflow_run_id") for t in study.trials} == trial_runs


def test_trial_runs_carry_their_worker_and_host(stack: StackStudy) -> None:
    exp = experiment_by_name(stack.url, stack.study)
    trial_tags = [tags_of(r) for r in search_runs(stack.url, exp["experiment_id"])
                  if tags_of(r).get("hpsearch.role") == "trial"]  # fmt: skip
    assert {t["hpsearch.worker"] for t in trial_tags} == set(WORKERS)
    # Both "hosts" are this machine here; the tag is still there on every run.
    assert {t["hpsearch.host"] for t in trial_tags} == {socket.gethostname()}


def test_artifacts_go_through_the_server(stack: StackStudy) -> None:
    exp = experiment_by_name(stack.url, stack.study)
    runs = search_runs(stack.url, exp["experiment_id"])
    trial_runs = [r for r in runs if tags_of(r).get("hpsearch.role") == "trial"]
    assert all(r["info"]["artifact_uri"].startswith("mlflow-artifacts:") for r in runs), [
        r["info"]["artifact_uri"] for r in runs
    ]
    completed = [r for r in trial_runs if tags_of(r).get("hpsearch.outcome") == "completed"]
    assert completed, [tags_of(r).get("hpsearch.outcome") for r in trial_runs]
    uploaded: set[str] = set()
    for run in completed:
        run_id = run["info"]["run_id"]
        files = _files(run_id, stack)
        assert {"learning_curve.png", "confusion_matrix.png"} <= files, files
        uploaded |= files
        # On disk under the server's --artifacts-destination, at the URI's path.
        rel = run["info"]["artifact_uri"].removeprefix("mlflow-artifacts:").lstrip("/")
        on_disk = stack.artifacts_dir / rel
        for name in files:
            assert (on_disk / name).is_file(), on_disk / name
        # And downloadable through the artifact proxy.
        url = f"{stack.url}/api/2.0/mlflow-artifacts/artifacts/{rel}/confusion_matrix.png"
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = resp.read()
        assert body.startswith(PNG) and body == (on_disk / "confusion_matrix.png").read_bytes()
    # The study's best trials (top-k) upload their best model too.
    assert "checkpoint/best.pt" in uploaded, uploaded
    # Nothing of that lives in the workers' own folders: no local mlruns/mlartifacts store,
    # no plot written next to the trials.
    for w, workdir in stack.workdirs.items():
        local = [p for p in workdir.rglob("*")
                 if p.name in {"mlruns", "mlartifacts", "learning_curve.png",
                               "confusion_matrix.png", "per_class_accuracy.csv"}]  # fmt: skip
        assert not local, (w, local)
