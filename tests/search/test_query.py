"""Reading studies back (`hpsearch.query` and the `status`, `best`, `studies` commands) on
studies in every shape a reader meets: none complete, non-finite values, conditional params,
several objectives, damaged or mistyped storages. Found by a review of the query API."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path

import hpsearch as hps
import optuna
import pytest
import sqlalchemy as sa
from cli_util import hpsearch
from hpsearch.query import _local_best_model, best_trials, list_studies, load_best_model
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState, create_trial


def _journal_study(workdir: Path, name: str, **kwargs: object) -> optuna.Study:
    workdir.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(workdir / "optuna.journal"))
    )
    return optuna.create_study(study_name=name, storage=storage, **kwargs)  # type: ignore[arg-type]


def _tables(url: str) -> set[str]:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as conn:
            return set(sa.inspect(conn).get_table_names())
    finally:
        eng.dispose()


def test_readers_create_no_schema_in_a_database_without_one(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """`studies`, `status`, `best` and the Python readers on a database (or a SQLite path)
    the URL names by mistake: nothing is created there."""
    from hpsearch.storage import normalize_url

    assert list_studies(pg_url) == []
    with pytest.raises(hps.StudyNotFoundError, match="no Optuna tables"):
        hps.load_study("x", storage=pg_url)
    r = hpsearch(["best", "-s", "x", "--storage", pg_url], subprocess_env)
    assert r.returncode == 1 and "no Optuna tables" in r.stderr, r.stderr
    assert _tables(normalize_url(pg_url)) == set()
    typo = tmp_path / "typo.db"
    r = hpsearch(["status", "-s", "x", "--storage", f"sqlite:///{typo}"], subprocess_env)
    assert r.returncode == 1 and "typo.db: no such file" in r.stderr, r.stderr  # as `studies`
    assert not typo.exists()


def test_a_schema_of_another_optuna_version_is_one_line(pg_url: str) -> None:
    from hpsearch.storage import normalize_url

    url = normalize_url(pg_url)
    optuna.create_study(storage=url, study_name="old")
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = 'v3.0.0.d'"))
    eng.dispose()
    with pytest.raises(hps.StorageError, match="optuna storage upgrade"):
        list_studies(pg_url)


def test_a_damaged_journal_or_a_folder_is_a_storage_error(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    bad = tmp_path / "bad.journal"
    bad.write_text("not json\nat all\n")
    with pytest.raises(hps.StorageError, match="not a readable Optuna journal"):
        hps.load_study("s", storage=str(bad))
    bad.write_text("1\n")  # JSON, but not an operation: a JSON-lines log named by mistake
    with pytest.raises(hps.StorageError, match="not a readable Optuna journal"):
        hps.load_study("s", storage=str(bad))
    # Another program's one-line log: Optuna skips a last line without its newline (one
    # being written), so this read as a journal of no studies, and a launch appended to it.
    other = tmp_path / "server.log"
    other.write_text("2026-12-04 started")
    r = hpsearch(["studies", "--storage", str(other)], subprocess_env)
    assert r.returncode == 1 and "its first line is not a JSON object" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert other.read_text() == "2026-12-04 started"
    folder = tmp_path / "dir.journal"
    folder.mkdir()
    r = hpsearch(["status", "-s", "s", "--storage", str(folder)], subprocess_env)
    assert r.returncode == 1 and "is a folder, not a journal file" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_best_trials_of_a_study_with_none_complete_has_its_columns(tmp_path: Path) -> None:
    study = _journal_study(tmp_path, "empty", direction="maximize")
    study.tell(
        study.ask({"lr": optuna.distributions.FloatDistribution(0.1, 1.0)}), state=TrialState.PRUNED
    )
    top = best_trials("empty", workdir=tmp_path)
    assert top.empty
    assert {"number", "value", "state", "mlflow_run_id", "checkpoint_uri"} <= set(top.columns)
    assert "params_lr" in top.columns  # a pruned trial drew it
    # A study launched by hpsearch: its search space's columns, before any trial has one,
    # and the README's own selection.
    from hpsearch.config import config_to_yaml, load_config
    from hpsearch.study import CONFIG_ATTR

    fresh = _journal_study(tmp_path, "fresh", direction="maximize")
    fresh.set_user_attr(CONFIG_ATTR, config_to_yaml(load_config("tiny")))
    top = best_trials("fresh", workdir=tmp_path)
    assert top[["number", "value", "params_lr", "mlflow_run_id"]].empty
    assert {"params_batch_size", "params_loss", "params_focal_gamma"} <= set(top.columns)


def test_best_json_is_strict_with_exact_params(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A diverged trial's inf is null in strict JSON (jq, JavaScript); an int parameter stays
    an int, and a conditional one a trial did not draw is absent, not null."""
    study = _journal_study(tmp_path, "s", direction="minimize")
    warm = IntDistribution(0, 5)
    opt = CategoricalDistribution(["sgd", "adamw"])
    study.add_trial(create_trial(value=0.5, params={"opt": "sgd", "warmup": 3},
                                 distributions={"opt": opt, "warmup": warm}))  # fmt: skip
    study.add_trial(create_trial(value=math.inf, params={"opt": "adamw"},
                                 distributions={"opt": opt}))  # fmt: skip
    study.add_trial(create_trial(value=-math.inf, params={"opt": "adamw"},
                                 distributions={"opt": opt}))  # fmt: skip

    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} in JSON")

    for cmd in (["best", "-s", "s", "-k", "3"], ["studies"], ["status", "-s", "s"]):
        r = hpsearch([*cmd, "--workdir", str(tmp_path), "--json"], subprocess_env)
        assert r.returncode == 0, r.stderr
        json.loads(r.stdout, parse_constant=strict)
    r = hpsearch(["best", "-s", "s", "-k", "3", "--workdir", str(tmp_path), "--json"],
                 subprocess_env)  # fmt: skip
    rows = json.loads(r.stdout)
    assert [row["number"] for row in rows] == [2, 0, 1]  # minimize: -inf first
    assert rows[0]["value"] is None and rows[2]["value"] is None
    assert rows[1]["params_warmup"] == 3 and isinstance(rows[1]["params_warmup"], int)
    assert "params_warmup" not in rows[0]
    r = hpsearch(["best", "-s", "s", "-k", "3", "--workdir", str(tmp_path)], subprocess_env)
    assert "params {'opt': 'sgd', 'warmup': 3}" in r.stdout, r.stdout


def test_studies_counts_each_state_as_the_budget_does_not(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: `studies` said "9 trials" where the launch said `/ 7`: a retried trial's failed
    tries are trials too. Each state is counted now."""
    study = _journal_study(tmp_path, "s", direction="maximize")
    for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.FAIL):
        value = 0.5 if state == TrialState.COMPLETE else None
        study.add_trial(create_trial(state=state, value=value, intermediate_values={1: 0.2}))
    _journal_study(tmp_path, "empty", direction="minimize")
    r = hpsearch(["studies", "--workdir", str(tmp_path)], subprocess_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "s: 4 trials (1 complete, 1 pruned, 2 fail), best 0.5 (trial 0)",
        "empty: 0 trials (none yet), best -",
    ]
    rows = list_studies(workdir=tmp_path)
    # every state, as `status` gives them (QA: `studies --json` left out those with none)
    assert rows[0]["counts"] == {"running": 0, "waiting": 0, "complete": 1, "pruned": 1,
                                 "fail": 2}  # fmt: skip
    # A multi-objective study's best is its front (QA: `best -`).
    mo = _journal_study(tmp_path, "mo", directions=["maximize", "minimize"])
    for values in ([0.9, 5.0], [0.8, 1.0], [0.7, 9.0]):  # the third is dominated
        mo.add_trial(create_trial(values=values))
    r = hpsearch(["studies", "--workdir", str(tmp_path)], subprocess_env)
    assert "mo: 3 trials (3 complete), best pareto 2" in r.stdout.splitlines(), r.stdout
    # None: said where it looked (QA: a forgotten --storage read "no studies").
    (tmp_path / "new").mkdir()
    r = hpsearch(["studies", "--workdir", str(tmp_path / "new")], subprocess_env)
    journal = tmp_path / "new" / "optuna.journal"
    assert r.returncode == 0 and r.stdout.strip() == (
        f"no studies in journal:{journal} (no journal there yet)"
    ), r.stdout + r.stderr
    # ... the default work folder too, not there yet (QA: "no such folder", exit 1).
    env = {k: v for k, v in subprocess_env.items() if k != "HPSEARCH_WORKDIR"}
    r = hpsearch(["studies"], env, cwd=tmp_path / "new")
    assert r.returncode == 0 and r.stdout.startswith("no studies in journal:"), r.stderr


def test_a_multi_objective_study_ranks_its_front_and_needs_a_trial_to_load(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    study = _journal_study(tmp_path, "mo", directions=["maximize", "minimize"])
    for values in ([0.5, 2.0], [0.9, 5.0], [0.2, 1.0], [0.1, 9.0]):
        study.add_trial(create_trial(values=values))
    top = best_trials("mo", workdir=tmp_path, k=5)
    assert list(top["number"]) == [1, 0, 2]  # the Pareto front, by the first objective
    st = hps.study_status("mo", workdir=tmp_path)
    assert st.pareto_size == 3 and st.best is not None and st.best["number"] == 1
    # `status` names the front, not one member of it as "best".
    r = hpsearch(["status", "--study", "mo", "--workdir", str(tmp_path)], subprocess_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pareto front: 3 trials; first by the first objective: trial 1" in r.stdout
    assert "best:" not in r.stdout
    with pytest.raises(hps.HpsearchError, match=r"multi-objective.*trial=NUMBER"):
        load_best_model("mo", workdir=tmp_path)
    with pytest.raises(hps.HpsearchError, match="trial 103: no such completed trial"):
        load_best_model("mo", workdir=tmp_path, trial=103)


def test_a_best_model_stored_relative_to_the_launch_folder_is_found_under_the_workdir(
    tmp_path: Path,
) -> None:
    """Older studies stored the best-model path relative to where the launch ran."""
    work = tmp_path / "run" / ".hpsearch"
    model = work / "checkpoints" / "tiny" / "trial-00000.best.pt"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"weights")
    trial = create_trial(
        value=0.5, user_attrs={"best_model": ".hpsearch/checkpoints/tiny/trial-00000.best.pt"}
    )
    assert _local_best_model(trial, work) == model
    absolute = create_trial(value=0.5, user_attrs={"best_model": str(model)})
    assert _local_best_model(absolute, tmp_path / "elsewhere") == model
    gone = create_trial(value=0.5, user_attrs={"best_model": "w/checkpoints/tiny/x.best.pt"})
    assert _local_best_model(gone, work) is None


def test_a_failed_download_never_shows_the_tracking_password(tmp_path: Path) -> None:
    from hpsearch.runs import download_best_model

    kept = {"mlflow_run_id": "abc123", "checkpoint_uri": "runs:/abc123/checkpoint/best.pt"}
    trial = create_trial(value=0.5, user_attrs=kept)
    with pytest.raises(hps.TrackingError) as info:
        download_best_model(trial, "http://bob:s3cret@127.0.0.1:9", tmp_path, tmp_path)
    assert "s3cret" not in str(info.value) and "bob:***@127.0.0.1:9" in str(info.value)
    # MLflow's own error, which holds the URI, is not chained to it (a traceback prints it).
    assert info.value.__cause__ is None and info.value.__suppress_context__
    # None logged to MLflow: said so, rather than to pass a tracking URI.
    unkept = create_trial(value=0.5, user_attrs={"mlflow_run_id": "abc123"})
    with pytest.raises(hps.HpsearchError, match="no model of it was kept"):
        download_best_model(unkept, "http://127.0.0.1:9", tmp_path, tmp_path)


def test_a_download_leaves_the_callers_mlflow_settings_and_reads_the_embedded_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader (a notebook) keeps its own MLflow HTTP retries and timeouts: hpsearch's
    short ones were left in its environment for good. With no tracking URI, the work
    folder's own MLflow store is read from disk (the embedded server stops with its
    launch); the error said no run held the model."""
    from hpsearch.runs import download_best_model
    from hpsearch.tracking.mlflow_logger import HTTP_POLICY

    for key in HTTP_POLICY:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")  # the caller's own
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    kept = {"mlflow_run_id": "abc123", "checkpoint_uri": "runs:/abc123/checkpoint/best.pt"}
    trial = create_trial(value=0.5, user_attrs=kept)
    with pytest.raises(hps.TrackingError):
        download_best_model(trial, "http://127.0.0.1:9", tmp_path, tmp_path)
    assert [k for k in HTTP_POLICY if k in os.environ] == ["MLFLOW_HTTP_REQUEST_TIMEOUT"]
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "120"
    with pytest.raises(hps.HpsearchError, match="no tracking URI was given"):
        download_best_model(trial, None, tmp_path, tmp_path)
    stored = tmp_path / "mlflow" / "artifacts" / "1" / "abc123" / "artifacts" / "checkpoint"
    stored.mkdir(parents=True)
    (stored / "best.pt").write_bytes(b"w")
    assert download_best_model(trial, None, tmp_path, tmp_path) == stored / "best.pt"


def test_the_checkpoint_column_drops_a_deleted_file_and_readers_check_their_arguments(
    tmp_path: Path,
) -> None:
    from hpsearch.query import checkpoint_uri

    gone = str(tmp_path / "trial-00003.best.pt")  # outside the top k since: deleted
    here = create_trial(value=0.5, user_attrs={"best_model": gone, "host": socket.gethostname()})
    assert checkpoint_uri(here) is None
    there = create_trial(value=0.5, user_attrs={"best_model": gone, "host": "another-host"})
    assert checkpoint_uri(there) == gone  # not seen from here
    Path(gone).write_bytes(b"w")
    assert checkpoint_uri(here) == gone
    with pytest.raises(hps.StorageError, match="no such folder"):
        list_studies(workdir=tmp_path / "mistyped")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        with pytest.raises(hps.StorageError, match="no such folder"):
            list_studies(workdir="mistyped")  # relative, as typed
    assert list_studies(workdir=tmp_path) == []  # a work folder with no study yet
    _journal_study(tmp_path, "only")
    with pytest.raises(hps.StudyNotFoundError, match="must be a non-empty string"):
        hps.load_study(None, workdir=tmp_path)  # type: ignore[arg-type]
    # A mistyped name says which studies are there (as launch lists its study files).
    with pytest.raises(
        hps.StudyNotFoundError, match=r"'onyl' not found in .*; studies here: only$"
    ):
        hps.load_study("onyl", workdir=tmp_path)
    # Named as the API's argument, not the CLI's option.
    with pytest.raises(hps.StorageError, match=r"^storage: 'mysql://u@h/db': unsupported"):
        hps.load_study("s", storage="mysql://u@h/db")


def test_every_library_exception_is_exported() -> None:
    import inspect

    from hpsearch import errors

    classes = {
        n for n, c in vars(errors).items() if inspect.isclass(c) and c.__module__ == errors.__name__
    }
    assert classes <= set(hps.__all__) and all(hasattr(hps, n) for n in classes)
    # dir() lists the lazy functions too (tab completion), before their first use
    import subprocess
    import sys

    code = "import hpsearch as h; print(sorted(set(h.__all__) - set(dir(h))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_another_hosts_best_model_comes_from_mlflow_before_a_file_at_its_path_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry another host ran and won with: at its path here lies this host's earlier try
    of the chain, half trained, which load_best_model returned."""
    import hpsearch.runs
    from hpsearch.query import best_model_file

    here_file = tmp_path / "trial-00002-abc.best.pt"
    here_file.write_bytes(b"the earlier try's")
    fetched = tmp_path / "fetched.best.pt"
    fetched.write_bytes(b"the winner's")
    calls: list[int] = []

    def download(trial: object, uri: object, workdir: object, dest: object) -> Path:
        calls.append(1)
        if uri is None:
            raise hps.TrackingError("no server")
        return fetched

    monkeypatch.setattr(hpsearch.runs, "download_best_model", download)
    kept = {"best_model": str(here_file), "checkpoint_uri": "runs:/r/checkpoint/best.pt"}
    mine = create_trial(value=0.5, user_attrs={**kept, "host": socket.gethostname()})
    assert best_model_file(mine, "http://mlflow", tmp_path, tmp_path) == here_file and not calls
    other = create_trial(value=0.5, user_attrs={**kept, "host": "other-host"})
    assert best_model_file(other, "http://mlflow", tmp_path, tmp_path) == fetched
    # No server to ask: the file (a work folder the hosts share) rather than nothing.
    assert best_model_file(other, None, tmp_path, tmp_path) == here_file
    # Not in MLflow: the file.
    shared = create_trial(value=0.5, user_attrs={"best_model": str(here_file), "host": "b"})
    assert best_model_file(shared, "http://mlflow", tmp_path, tmp_path) == here_file


def test_best_trials_gives_none_for_a_missing_text_value(tmp_path: Path) -> None:
    """QA: under pandas 3 a text column with a gap (one trial's `mlflow_run_id` or
    `checkpoint_uri`, and not another's) held NaN there, which is true: `if
    row.checkpoint_uri:` held for a deleted file. None, as under pandas 2."""
    study = _journal_study(tmp_path, "s", direction="maximize")
    for value, attrs in ((0.9, {"mlflow_run_id": "abc"}), (0.5, {})):
        study.add_trial(create_trial(value=value, user_attrs=attrs))
    top = best_trials("s", workdir=tmp_path)
    assert top["mlflow_run_id"].tolist() == ["abc", None]
    assert top["value"].tolist() == [0.9, 0.5]  # numbers stay numbers


def test_the_api_takes_paths_as_strings_and_refuses_storage_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook passes `workdir="runs"` and `storage=Path(...)`: both were a TypeError."""
    study = _journal_study(tmp_path, "s", direction="maximize")
    study.add_trial(create_trial(value=0.5, params={"b": 32},
                                 distributions={"b": IntDistribution(16, 64)}))  # fmt: skip
    assert best_trials("s", workdir=str(tmp_path))["number"].tolist() == [0]
    assert best_trials("s", storage=tmp_path / "optuna.journal")["number"].tolist() == [0]
    assert hps.study_status("s", workdir=str(tmp_path)).counts["complete"] == 1
    assert [r["name"] for r in list_studies(workdir=str(tmp_path))] == ["s"]
    with pytest.raises(hps.StorageError, match="expected a storage URL or a journal file"):
        best_trials("s", storage=study._storage)  # type: ignore[arg-type]
    for k in (0, None, "3", 2.5, True):
        with pytest.raises(hps.ConfigError, match="must be a whole number"):
            best_trials("s", workdir=tmp_path, k=k)  # type: ignore[arg-type]
    import numpy as np

    assert len(best_trials("s", workdir=tmp_path, k=np.int64(3))) == 1  # type: ignore[arg-type]
    # A trial number given as text matched no trial: "trial 0: no such completed trial".
    for trial in ("0", 0.0, True, -1):
        with pytest.raises(hps.ConfigError, match=r"trial: .*: must be a trial number"):
            hps.load_best_model("s", workdir=tmp_path, trial=trial)  # type: ignore[arg-type]
    # An empty HPSEARCH_WORKDIR is unset, as for the CLI: ./.hpsearch, not ./
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HPSEARCH_WORKDIR", "")
    (tmp_path / ".hpsearch").mkdir()
    (tmp_path / "optuna.journal").rename(tmp_path / ".hpsearch" / "optuna.journal")
    assert list(best_trials("s")["number"]) == [0]


def test_readers_leave_no_database_connection_open(pg_url: str) -> None:
    """Each reader made its own engine and left its pooled connection to the garbage
    collector: a dashboard polling `study_status` held a growing number of them."""
    import gc

    from hpsearch.storage import normalize_url

    url = normalize_url(pg_url)
    made = optuna.storages.RDBStorage(url, engine_kwargs={"poolclass": sa.pool.NullPool})
    optuna.create_study(storage=made, study_name="s", direction="maximize").add_trial(
        create_trial(value=0.5, params={"b": 32}, distributions={"b": IntDistribution(16, 64)})
    )
    database = sa.make_url(url).database
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    gc.disable()  # what a busy process may not collect for a while
    try:
        from hpsearch.config import load_config
        from hpsearch.runner import check_relaunch

        relaunched = load_config("tiny", ["name=s"])
        for _ in range(3):
            hps.study_status("s", storage=pg_url)
            best_trials("s", storage=pg_url)
            list_studies(pg_url)
            check_relaunch(relaunched, pg_url, Path("."))  # a launch's (review: held one)
        sql = sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"
        )
        deadline = time.monotonic() + 10  # a closed connection's backend exits soon after
        while True:
            with eng.connect() as conn:
                others = conn.execute(sql, {"d": database}).scalar_one()
            if others == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        gc.enable()
        eng.dispose()
    assert others == 0


def test_status_median_start_up_of_an_even_count(tmp_path: Path) -> None:
    study = _journal_study(tmp_path, "s", direction="maximize")
    for i, startup in enumerate((1.0, 9.0)):
        study.add_trial(create_trial(value=float(i), user_attrs={"startup_s": startup}))
    assert hps.study_status("s", workdir=tmp_path).startup_s_median == 5.0  # was 9.0


def test_status_tells_two_launches_workers_of_one_name_apart_by_pid(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Two launches on one host both name their first worker host:w0; status showed two
    running trials "on host:w0 (host)" with nothing to tell which process is which. A
    worker of this host that is gone (killed) is said to be (QA: running for good)."""
    import subprocess
    import sys

    study = _journal_study(tmp_path, "s", direction="maximize")
    host = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for pid in (os.getpid(), gone.pid):
        trial = study.ask()
        for key, value in {"worker": f"{host}:w0", "host": host, "pid": pid}.items():
            trial.set_user_attr(key, value)
        trial.report(0.5, 1)
    study.ask()  # claimed, not yet named: nothing to show but its number
    out = hpsearch(["status", "--study", "s", "--workdir", str(tmp_path)], subprocess_env)
    assert out.returncode == 0, out.stderr
    running = [ln for ln in out.stdout.splitlines() if ln.startswith("running:")]
    assert running == [
        f"running: trial 0 on {host}:w0 ({host}, pid {os.getpid()}), last epoch 1",
        f"running: trial 1 on {host}:w0 ({host}, pid {gone.pid}), last epoch 1 | its worker "
        "is gone: failed and retried by a worker's stale check or the next launch",
        "running: trial 2 on - (-), last epoch -",
    ]
    st = hps.study_status("s", workdir=tmp_path)
    assert [r["pid"] for r in st.running] == [os.getpid(), gone.pid, None]
    assert [r["worker_alive"] for r in st.running] == [True, False, None]
    assert all(r["started"] is not None for r in st.running)
    assert (st.budget, st.room) == (None, None)  # not launched by hpsearch: no budget


def test_train_trial_n_takes_an_enqueued_trials_params_and_refuses_none(tmp_path: Path) -> None:
    """`hpsearch train --trial N` on a waiting trial (enqueued: its params are in Optuna's
    system attrs) trained with the study's defaults under trial N's name."""
    from hpsearch.config import load_config
    from hpsearch.runner import fixed_params

    cfg = load_config("tiny")
    study = _journal_study(tmp_path, cfg.name, direction="maximize")
    study.enqueue_trial({"lr": 0.02, "batch_size": 16})
    assert fixed_params(cfg, None, 0, None, tmp_path) == {"lr": 0.02, "batch_size": 16}
    study.add_trial(create_trial(state=TrialState.FAIL))  # failed before it drew any
    with pytest.raises(hps.HpsearchError, match=r"trial 1 .*FAIL.* has no parameters"):
        fixed_params(cfg, None, 1, None, tmp_path)


def test_train_trial_n_takes_its_seed_and_its_study_by_name_alone(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: `train --trial 2` trained with the study's seed, not trial 2's (`trainer.seed` +
    its retry chain's first trial), so it reproduced nothing; and it needed a study file,
    where `status` takes the stored name."""
    from hpsearch.config import load_config
    from hpsearch.runner import trial_seed, trial_threads
    from hpsearch.study import CONFIG_ATTR, config_to_yaml

    cfg = load_config("tiny", ["name=team", "trainer.seed=100"])
    study = _journal_study(tmp_path, "team", direction="maximize")
    study.set_user_attr(CONFIG_ATTR, config_to_yaml(cfg))
    lr = {"lr": optuna.distributions.FloatDistribution(1e-3, 0.5, log=True)}
    for _ in range(3):
        study.add_trial(create_trial(value=0.5, params={"lr": 0.1}, distributions=lr))
    study.add_trial(
        create_trial(
            value=0.6, params={"lr": 0.1}, distributions=lr, system_attrs={"failed_trial": 1}
        )
    )  # a retry of trial 1
    assert [trial_seed(cfg, n, None, tmp_path) for n in (0, 2, 3)] == [100, 102, 101]
    # ... and its CPU threads, where its worker recorded them (QA: all the cores summed in
    # another order, and the values differed from epoch 1 on).
    study.add_trial(create_trial(value=0.6, params={"lr": 0.1}, distributions=lr,
                                 user_attrs={"torch_threads": 1}))  # fmt: skip
    assert [trial_threads(cfg, n, None, tmp_path) for n in (3, 4)] == [None, 1]
    out = hpsearch(["train", "--study", "team", "--trial", "3", "--workdir", str(tmp_path),
                    "--no-tracking", "--data-dir", str(tmp_path / "none")],
                   subprocess_env, cwd=tmp_path)  # fmt: skip
    # Past the study's name (no file has it): stopped at its data, not "no such study file".
    assert out.returncode == 65, out.stderr
    assert "flowers-102 not found or incomplete" in out.stderr


def test_a_trial_queued_by_hand_runs_first_once_and_within_the_budget(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """`hpsearch enqueue` and `hpsearch.enqueue_trial` (Optuna's enqueue_trial, checked
    against the study's launched search space): the next trials a launch runs are these,
    once each, none past the budget."""
    from cli_util import DUMMY
    from hpsearch.config import load_config
    from hpsearch.errors import ConfigError, HpsearchError, StudyNotFoundError
    from hpsearch.storage import open_storage, resolve_storage
    from hpsearch.study import create_or_load

    # made as a launch makes it: its config and budget stored, no trial run yet
    cfg = load_config("tiny", ["budget.n_trials=3"])
    create_or_load(cfg, open_storage(resolve_storage(pg_url, tmp_path)))
    cli = ["enqueue", "--study", "tiny", "--storage", pg_url]

    out = hpsearch([*cli, "--params", '{"lr": 0.02}'], subprocess_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == 'queued trial 0 of study tiny: {"lr": 0.02}'  # as given
    out = hpsearch([*cli, "--params", '{"lr": 0.02}'], subprocess_env)
    assert out.returncode == 0, out.stderr
    assert "not queued: trial 0 of study tiny (waiting) already has these params" in out.stdout
    for params, shown in (
        ('{"lr": 5}', "params: lr: 5: outside its range 0.001..0.5"),
        ('{"focal_gamma": 2.0}', "this trial gives no loss"),
        ('{"momentum": 0.8}', "params: momentum: 0.8: not searched here"),
        ('{"lr": 0.1', "--params: '{\"lr\": 0.1': not valid JSON"),
        ("[0.1]", "must be a JSON object"),
    ):
        out = hpsearch([*cli, "--params", params], subprocess_env)
        assert out.returncode == 1 and shown in out.stderr, (params, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr

    assert hps.enqueue_trial("tiny", {"loss": "focal", "focal_gamma": 2}, pg_url).number == 1
    done = hps.enqueue_trial("tiny", {"batch_size": 64}, pg_url)
    assert (done.number, done.queued, done.params) == (2, True, {"batch_size": 64})
    with pytest.raises(HpsearchError, match=r"budget.n_trials \(3\) has no room.*"
                       r"\(hpsearch enqueue --trials 4 \.\.\.\)"):  # fmt: skip
        hps.enqueue_trial("tiny", {"batch_size": 32}, pg_url)
    # A spent budget is raised as the trial is queued, in one step (QA: a launch given
    # --trials N first had its workers fill the room before the trial was queued); a budget
    # that leaves no room is refused, and not set.
    with pytest.raises(HpsearchError, match=r"n_trials: 3: leaves study 'tiny' no room"):
        hps.enqueue_trial("tiny", {"batch_size": 32}, pg_url, n_trials=3)
    status = hpsearch(["status", "--study", "tiny", "--storage", pg_url], subprocess_env)
    assert "budget: 3 trials (finished, running and queued count), room for 0 more" in (
        status.stdout
    ), status.stdout
    out = hpsearch([*cli, "--params", '{"batch_size": 32}', "--trials", "4"], subprocess_env)
    assert out.stdout.strip() == 'queued trial 3 of study tiny: {"batch_size": 32}', out.stderr
    st = hps.study_status("tiny", storage=pg_url)
    assert (st.budget, st.room) == (4, 0)
    with pytest.raises(ConfigError, match="params: loss: 'hinge': not among its choices"):
        hps.enqueue_trial("tiny", {"loss": "hinge"}, pg_url)
    with pytest.raises(StudyNotFoundError, match="'nope' not found"):
        hps.enqueue_trial("nope", {"lr": 0.1}, pg_url)

    out = hpsearch(
        ["launch", "--study", "tiny", "--storage", pg_url, "--workers", "1", "--trials", "4",
         "--no-tracking", "--train-fn", DUMMY, "--workdir", str(tmp_path / "w"),
         "--set", "budget.max_epochs=2"],
        subprocess_env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    trials = optuna.load_study(study_name="tiny", storage=pg_url).get_trials()
    assert len(trials) == 4 and all(t.state.is_finished() for t in trials)
    assert trials[0].params["lr"] == 0.02
    assert (trials[1].params["loss"], trials[1].params["focal_gamma"]) == ("focal", 2.0)
    assert trials[2].params["batch_size"] == 64
    assert trials[3].params["batch_size"] == 32


def test_status_best_and_enqueue_take_the_study_file_a_launch_took(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """`launch --study my.yaml` names the study by the file's `name` (else its stem); the
    readers took only that name, so the path a user had just launched with was "not
    found". They take the file too, and a missing one is the loader's one line."""
    from hpsearch.config import find_study_file, load_config, study_name
    from hpsearch.storage import open_storage, resolve_storage
    from hpsearch.study import create_or_load

    text = find_study_file("tiny").read_text()
    mine = tmp_path / "my-study.yaml"
    mine.write_text(text.replace("name: tiny", "name: flowers-mine"))
    assert "flowers-mine" in mine.read_text()
    cfg = load_config(mine, ["budget.n_trials=3"])
    work = tmp_path / "w"
    create_or_load(cfg, open_storage(resolve_storage(None, work)))
    assert study_name(str(mine)) == "flowers-mine"
    assert study_name("flowers-mine") == "flowers-mine"
    assert study_name("team/flowers") == "team/flowers"  # a name, not a file here

    common = ["--study", str(mine), "--workdir", str(work)]
    out = hpsearch(["enqueue", *common, "--params", '{"lr": 0.02}'], subprocess_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == 'queued trial 0 of study flowers-mine: {"lr": 0.02}'
    out = hpsearch(["status", *common, "--json"], subprocess_env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["name"] == "flowers-mine"
    out = hpsearch(["best", *common], subprocess_env)
    assert (out.returncode, out.stdout.strip()) == (0, "no completed trials yet"), out.stderr
    for command in ("status", "best"):
        out = hpsearch([command, "--study", str(tmp_path / "nope.yaml"), "--workdir", str(work)],
                       subprocess_env)  # fmt: skip
        assert out.returncode == 1
        assert out.stderr.strip() == f"Error: {tmp_path / 'nope.yaml'}: study file not found"

    # `launch --study foo` reads ./studies/foo.yaml, whose `name` the study has; a file
    # without the suffix is a study file too, as `launch` takes it.
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "foo.yaml").write_text(mine.read_text())
    (tmp_path / "plain").write_text(mine.read_text())
    for given in ("foo", "plain", str(tmp_path / "plain")):
        out = hpsearch(["status", "--study", given, "--workdir", str(work), "--json"],
                       subprocess_env, cwd=tmp_path)  # fmt: skip
        assert out.returncode == 0, (given, out.stderr)
        assert json.loads(out.stdout)["name"] == "flowers-mine"
    # A file of the study's name that is no study file (notes): the name is read.
    (tmp_path / "flowers-mine").write_text("notes\n")
    out = hpsearch(["status", "--study", "flowers-mine", "--workdir", str(work), "--json"],
                   subprocess_env, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0 and json.loads(out.stdout)["name"] == "flowers-mine", out.stderr
    out = hpsearch(["status", "--study", "bar", "--workdir", str(work)], subprocess_env,
                   cwd=tmp_path)  # fmt: skip
    assert out.returncode == 1
    journal = work / "optuna.journal"
    assert out.stderr.strip() == (
        f"Error: study 'bar' not found in journal:{journal}; studies here: flowers-mine"
    )


def test_train_params_outside_the_search_space_are_said_in_one_warning(tmp_path: Path) -> None:
    """QA: `train --params '{"lr": 5}'` on a study searching lr in [0.001, 0.5] trained to a
    1e12 val_loss without a word. Allowed (a probe past the space's edge), but said."""
    import warnings

    from hpsearch.config import load_config
    from hpsearch.errors import HpsearchWarning
    from hpsearch.runner import fixed_params

    cfg = load_config("tiny")
    with pytest.warns(HpsearchWarning) as caught:
        fixed_params(cfg, '{"lr": 5, "batch_size": 48, "loss": "ce"}', None, None, tmp_path)
    assert sorted(str(w.message) for w in caught) == [
        "--params: batch_size: 48: outside the study's search space (choices [32, 64])",
        "--params: lr: 5: outside the study's search space (0.001 to 0.5)",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed_params(cfg, '{"lr": 0.1, "batch_size": 64}', None, None, tmp_path)
        # The CLI's check before a server starts: run_fixed warns, once (QA: said twice).
        fixed_params(cfg, '{"lr": 5}', None, None, tmp_path, warn=False)
    # One the run would not read, as a study file refuses a searched one (QA).
    with pytest.warns(HpsearchWarning) as caught:
        fixed_params(cfg, '{"loss": "focal", "label_smoothing": 0.1}', None, None, tmp_path)
    assert [str(w.message) for w in caught] == [
        "--params: label_smoothing: 0.1: not read: the trainer reads it only with loss "
        "label_smoothing"
    ]


def test_a_moved_work_folders_best_model_is_found_under_it(tmp_path: Path) -> None:
    """QA: with tracking off, a work folder moved (or mounted elsewhere) lost its models:
    `best --json` said null and load_best_model "no model of it was kept", the file there."""
    import socket

    import optuna
    from hpsearch.query import _local_best_model, checkpoint_uri

    moved = tmp_path / "moved" / ".hpsearch"
    f = moved / "checkpoints" / "tiny" / "trial-00002-9479fccd.best.pt"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"weights")
    was = tmp_path / "gone" / ".hpsearch" / "checkpoints" / "tiny" / f.name
    trial = optuna.trial.create_trial(
        value=0.5, user_attrs={"best_model": str(was), "host": socket.gethostname()}
    )
    assert checkpoint_uri(trial) is None  # where it was written: gone
    assert checkpoint_uri(trial, moved) == str(f)
    assert _local_best_model(trial, moved) == f
    assert checkpoint_uri(trial, tmp_path / "other") is None
    # A study named "checkpoints" (review: the last such part was taken for the folder).
    g = moved / "checkpoints" / "checkpoints" / f.name
    g.parent.mkdir()
    g.write_bytes(b"w")
    gone = tmp_path / "gone" / ".hpsearch" / "checkpoints" / "checkpoints" / f.name
    named = optuna.trial.create_trial(value=0.5, user_attrs={"best_model": str(gone)})
    assert _local_best_model(named, moved) == g
    f.unlink()  # deleted (outside keep_top_k): none, as before
    assert checkpoint_uri(trial, moved) is None and _local_best_model(trial, moved) is None


def test_train_trial_n_finds_its_data_where_the_launch_did(tmp_path: Path) -> None:
    """Review: a trial's recorded config holds no root, so `train --trial N` without
    --data-dir looked in ./data, not where the launch had found the data."""
    from hpsearch.config import config_to_yaml, load_config
    from hpsearch.runner import trial_config
    from hpsearch.study import CONFIG_ATTR, CONFIG_ID_ATTR, CONFIG_OF_ATTR, config_id

    launched = load_config("tiny", ["dataset.root=/launch/data"])
    own = config_to_yaml(launched, trial_only=True)
    study = _journal_study(tmp_path, "tiny", direction="maximize")
    study.set_user_attr(CONFIG_ATTR, config_to_yaml(launched))
    study.set_user_attr(CONFIG_OF_ATTR + config_id(own), own)
    study.add_trial(create_trial(value=0.5, user_attrs={CONFIG_ID_ATTR: config_id(own)}))
    plain = load_config("tiny")  # the shipped file: no root
    assert trial_config(plain, None, tmp_path, trial_number=0).dataset.root == "/launch/data"
    given = load_config("tiny", data_dir="/here")
    assert trial_config(given, None, tmp_path, trial_number=0).dataset.root == "/here"
