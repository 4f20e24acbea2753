"""A real study, end to end: `hpsearch launch` on PostgreSQL with its embedded MLflow server,
real Flowers-102 training, then everything checked through MlflowClient only."""

from __future__ import annotations

import json
from pathlib import Path

import hpsearch as hps
import numpy as np
import pytest
from cli_util import hpsearch
from PIL import Image

pytestmark = pytest.mark.slow


def test_study_in_mlflow_and_best_model(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str], flowers_root: Path
) -> None:
    from hpsearch.tracking.server import start_local_server
    from mlflow.tracking import MlflowClient

    work = tmp_path / "w"
    r = hpsearch(
        ["launch", "--study", "tiny", "--workers", "2", "--trials", "4", "--storage", pg_url,
         "--workdir", str(work), "--device", "cpu", "--data-dir", str(flowers_root),
         "--set", "budget.max_epochs=2", "--set", "pruner.options={n_startup_trials: 1, n_warmup_steps: 0}",
         "--set", "search_space.lr={type: float, low: 0.001, high: 0.5, log: true}",
         "--set", "trainer.evaluate_test=true",
         "--set", "enqueue_trials=[{lr: 0.05, loss: focal, focal_gamma: 1.5}]"],
        subprocess_env, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MLflow UI: http://127.0.0.1:" in r.stdout
    assert "Downloading artifacts" not in r.stdout + r.stderr  # no MLflow progress bars
    study = hps.load_study("tiny", storage=pg_url)
    trials = study.get_trials()
    assert len(trials) == 4
    # A relaunch the storage refuses (another direction) leaves the study run as it was:
    # not reopened, retagged with its sampler, nor closed as KILLED.
    r = hpsearch(
        ["launch", "--study", "tiny", "--workers", "1", "--storage", pg_url, "--workdir",
         str(work), "--device", "cpu", "--data-dir", str(flowers_root),
         "--set", "objective.direction=minimize", "--set", "sampler.name=random",
         "--set", "sampler.options={}"],
        subprocess_env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 1 and "already exists with directions" in r.stderr, r.stderr

    # launch stopped its server; a new one on the same store shows the runs again.
    with start_local_server(work) as server:
        client = MlflowClient(server.url)
        exp = client.get_experiment_by_name("tiny")
        assert exp is not None
        runs = client.search_runs([exp.experiment_id], max_results=100)
        parents = [r for r in runs if r.data.tags.get("hpsearch.role") == "study"]
        children = [r for r in runs if r.data.tags.get("hpsearch.role") == "trial"]
        assert len(parents) == 1 and len(children) == 4
        parent = parents[0]
        assert parent.data.tags["hpsearch.sampler"] == "tpe"
        assert "hpsearch.version" in parent.data.tags
        assert parent.info.status == "FINISHED"
        parent_files = {a.path for a in client.list_artifacts(parent.info.run_id)}
        assert {"study.yaml", "trials.csv"} <= parent_files

        by_number = {int(c.data.tags["optuna.trial_number"]): c for c in children}
        for t in trials:
            run = by_number[t.number]
            # Cross-links both ways.
            assert t.user_attrs["mlflow_run_id"] == run.info.run_id
            assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
            assert run.info.run_name == f"trial-{t.number}"
            for name, value in t.params.items():
                assert run.data.params[name] == str(value)
            # A searched parameter the trial did not sample (its `when` did not hold) is
            # not logged with the trainer's default: every trial lacks one of the two.
            unsampled = set(hps.load_config("tiny").search_space) - set(t.params)
            assert unsampled and not unsampled & set(run.data.params), (t.params, unsampled)
            for derived in (
                "effective_lr",
                "effective_batch_size",
                "dataset",
                "arch",
                "image_size",
            ):
                assert derived in run.data.params
            # how its accuracies were taken: the tiny study's defaults
            assert run.data.params["eval_image_size"] == run.data.params["image_size"]
            assert run.data.params["eval_flip"] == "False"
            assert run.data.tags["hpsearch.worker"] == t.user_attrs["worker"]
            # the study's first trial was the file's (enqueue_trials), the rest drawn
            enqueued = run.data.tags.get("hpsearch.enqueued")
            assert enqueued == ("focal_gamma,loss,lr" if t.number == 0 else None), t.number
            if t.number == 0:
                assert {k: t.params[k] for k in ("lr", "loss", "focal_gamma")} == {
                    "lr": 0.05, "loss": "focal", "focal_gamma": 1.5}  # fmt: skip
            steps = client.get_metric_history(run.info.run_id, "val_acc")
            assert [m.step for m in steps] == sorted(t.intermediate_values)
            outcome = t.user_attrs["outcome"]
            expected = {"finished": "FINISHED", "pruned": "KILLED"}.get(outcome, "FAILED")
            assert run.info.status == expected, (t.number, outcome)
            if outcome == "pruned":
                assert run.data.tags["hpsearch.pruned_at_epoch"] == str(len(steps))
            files = {a.path for a in client.list_artifacts(run.info.run_id)}
            plots = {"learning_curve.png", "confusion_matrix.png", "per_class_accuracy.csv"}
            if outcome not in ("finished", "early_stopped", "time_limit"):
                # a pruned trial keeps its metrics (MLflow charts them), and no plots
                assert not plots & files, (t.number, outcome, files)
            else:
                assert plots <= files
                assert "best_val_acc" in run.data.metrics
                png = client.download_artifacts(
                    run.info.run_id, "confusion_matrix.png", str(tmp_path)
                )
                with Image.open(png) as im:
                    im.load()
                    assert im.size[0] > 100
        finished = [t for t in trials if t.user_attrs["outcome"] == "finished"]
        assert finished, "at least one trial must finish"

        # The best model: ONNX on the parent run runs in onnxruntime.
        best = study.best_trial
        model_files = {a.path for a in client.list_artifacts(parent.info.run_id, "model")}
        assert "model/best_model.onnx" in model_files
        # exported by the best trial's worker, and copied to the study run at the end
        best_run = by_number[best.number].info.run_id
        assert "model/best_model.onnx" in {a.path for a in client.list_artifacts(best_run, "model")}
        import onnxruntime as ort

        onnx_path = client.download_artifacts(
            parent.info.run_id, "model/best_model.onnx", str(tmp_path)
        )
        sess = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
        (logits,) = sess.run(None, {sess.get_inputs()[0].name: x})
        assert logits.shape == (2, 102)
        # It names its outputs and its input (QA: only load_best_model could).
        meta = sess.get_modelmeta().custom_metadata_map
        names = json.loads(meta["hpsearch.class_names"])
        assert len(names) == 102 and names[0] == "pink primrose", names[:3]
        assert meta["hpsearch.input"].startswith("float32 NCHW RGB, 32 x 32 px: the shorter")
        assert json.loads(meta["hpsearch.mean"]) == [0.485, 0.456, 0.406]

        # best_trials carries the run ids; load_best_model gives the logged accuracy back.
        df = hps.best_trials("tiny", storage=pg_url, k=2)
        assert df.iloc[0]["mlflow_run_id"] == by_number[best.number].info.run_id
        assert df.iloc[0]["checkpoint_uri"]
        model = hps.load_best_model("tiny", storage=pg_url, workdir=work)
        from hpsearch.trainer import evaluate_model

        cfg = hps.load_config("tiny", ["budget.max_epochs=2"], data_dir=str(flowers_root))
        acc, _ = evaluate_model(cfg, best.params, model, "val", work, "cpu")
        logged = by_number[best.number].data.metrics["best_val_acc"]
        assert acc == pytest.approx(logged, abs=1e-6)
        assert acc == pytest.approx(best.value, abs=1e-6)
        summary = json.loads(json.dumps(dict(by_number[best.number].data.metrics)))
        assert summary["best_val_acc"] > 1 / 102
    # Also reachable from the CLI.
    out = hpsearch(
        ["best", "--study", "tiny", "--storage", pg_url, "--json"], subprocess_env
    ).stdout
    assert json.loads(out)[0]["mlflow_run_id"] == df.iloc[0]["mlflow_run_id"]


def test_multi_objective_study_with_mlflow(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str], flowers_root: Path
) -> None:
    """A two-objective study (accuracy up, training seconds down) through the real launch,
    MLflow included: every trial completes with both values, a trial on the Pareto front
    gets its best model uploaded, and the CLI shows both values."""
    from hpsearch.tracking.server import start_local_server
    from mlflow.tracking import MlflowClient

    work = tmp_path / "w"
    storage = ["--storage", pg_url, "--workdir", str(work)]
    r = hpsearch(
        ["launch", "--study", "tiny", "--workers", "1", "--trials", "2", *storage,
         "--device", "cpu", "--data-dir", str(flowers_root),
         "--set", "budget.max_epochs=1", "--set", "pruner.name=none",
         "--set", "pruner.options={}", "--set", "sampler.options={}",
         "--set", "objective={metric: [val_acc, train_seconds], direction: [maximize, minimize]}"],
        subprocess_env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    trials = hps.load_study("tiny", storage=pg_url).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    assert all(len(t.values) == 2 for t in trials)
    # The first trial to complete has nothing to dominate it: its model is in MLflow.
    assert "checkpoint_uri" in trials[0].user_attrs
    for args in (["best", "--study", "tiny"], ["status", "--study", "tiny"]):
        out = hpsearch([*args, *storage], subprocess_env, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert ("values [" if args[0] == "status" else "value [") in out.stdout  # both
    with start_local_server(work) as server:  # the launch's own server stopped with it
        client = MlflowClient(server.url)
        exp = client.get_experiment_by_name("tiny")
        assert exp is not None
        runs = client.search_runs([exp.experiment_id], max_results=10)
        trial_runs = [x for x in runs if x.data.tags.get("hpsearch.role") == "trial"]
        assert [x.info.status for x in trial_runs] == ["FINISHED", "FINISHED"]


def test_a_launch_logs_the_study_artifacts_at_its_end_that_the_last_tell_could_not(
    tmp_path: Path,
) -> None:
    """QA: MLflow down when the last trial was told: the study's artifacts (trials.csv,
    plots, the ONNX model) failed then, and the launch closed the study run FINISHED
    without them, the server back by its end. They are logged again at its end; where
    MLflow still takes none, the launch says to launch again."""
    import threading
    import types

    import optuna
    from hpsearch.config import load_config
    from hpsearch.launcher import Launcher
    from hpsearch.runs import open_study_run
    from hpsearch.storage import open_storage, resolve_storage
    from hpsearch.study import create_or_load, study_uid
    from hpsearch.tracking.server import free_port, start_local_server
    from mlflow.tracking import MlflowClient

    cfg = load_config("tiny", ["budget.n_trials=1", "tracking.onnx=false"])
    spec = resolve_storage(None, tmp_path)
    study = create_or_load(cfg, open_storage(spec))
    study.add_trial(optuna.trial.create_trial(
        params={"lr": 0.01}, distributions={"lr": optuna.distributions.FloatDistribution(
            1e-3, 1.0, log=True)}, value=0.5,
    ))  # fmt: skip
    told = threading.Thread(target=lambda: None)  # the last tell's finalizer: it logged none
    told.start()
    told.join()

    def launch(uri: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            _finalizer=told, _finalized=[], cfg=cfg, spec=spec, study=study, _messages=[],
            opts=types.SimpleNamespace(workdir=tmp_path, tracking_uri=uri), _uid=study_uid(study),
        )  # fmt: skip

    server = start_local_server(tmp_path / "store")
    try:
        parent = open_study_run(cfg, spec, server.url, study_uid(study, mint=True))
        ended = launch(server.url)
        Launcher._finish_tracking(ended, server.url, "budget")  # type: ignore[arg-type]
        client = MlflowClient(server.url)
        assert "trials.csv" in [a.path for a in client.list_artifacts(parent)]
        assert "logged trials.csv on the study run" in ended._messages
        assert client.get_run(parent).info.status == "FINISHED"
    finally:
        server.release()
    down = launch(f"http://127.0.0.1:{free_port()}")
    Launcher._finish_tracking(down, down.opts.tracking_uri, "budget")  # type: ignore[arg-type]
    assert any("launch again to log them" in m for m in down._messages), down._messages


def test_two_studies_of_one_name_on_one_server_keep_their_runs_apart(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: two people's studies of one name (each on the default journal of their own work
    folder) logging to one team server: the second launch took the first's study run, and
    both studies' trial runs (two `trial-0`, two `trial-1`) were nested under it. Each
    Optuna study now has a uid its runs carry, and a study run of its own. A study an
    earlier version ran takes that version's run, which no uid tags; a new study of its
    name does not (review: it did)."""
    from cli_util import DUMMY
    from hpsearch.study import STUDY_UID_ATTR
    from hpsearch.tracking.server import start_local_server
    from mlflow.tracking import MlflowClient

    with start_local_server(tmp_path / "team") as server:

        def launch(folder: str, trials: int) -> None:
            out = hpsearch(["launch", "--study", "tiny", "--trials", str(trials), "--workers",
                            "1", "--workdir", str(tmp_path / folder), "--train-fn", DUMMY,
                            "--tracking-uri", server.url], subprocess_env)  # fmt: skip
            assert out.returncode == 0, out.stdout + out.stderr

        def study_run(folder: str) -> str:
            study = hps.load_study("tiny", workdir=tmp_path / folder)
            uid = study.user_attrs[STUDY_UID_ATTR]
            (parent,) = client.search_runs(
                [exp_id], f"tags.`hpsearch.study_uid` = '{uid}' and tags.`hpsearch.role` = 'study'"
            )
            children = client.search_runs(
                [exp_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
            )
            runs = sorted(str(t.user_attrs["mlflow_run_id"]) for t in study.trials)
            assert sorted(r.info.run_id for r in children) == runs, folder
            return str(parent.info.run_id)

        client = MlflowClient(server.url)
        launch("alice", 2)
        exp = client.get_experiment_by_name("tiny")
        assert exp is not None
        exp_id = exp.experiment_id
        alices = study_run("alice")
        # As an earlier version left it: no uid on the study or on its study run.
        hps.load_study("tiny", workdir=tmp_path / "alice").set_user_attr(STUDY_UID_ATTR, "")
        client.delete_tag(alices, "hpsearch.study_uid")
        launch("bob", 2)
        assert study_run("bob") != alices
        assert "hpsearch.study_uid" not in client.get_run(alices).data.tags  # not bob's
        launch("alice", 3)  # her next launch takes it: her third trial's run nested there
        assert study_run("alice") == alices
