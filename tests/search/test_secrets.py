"""A database password never shows up in output, logs, files, MLflow params, tags or artifacts.

The local PostgreSQL uses trust auth, so a URL with any password connects: that lets a real
study carry a recognisable secret end to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_util import DUMMY, hpsearch

SECRET = "Zq7-s3cret-PW-xyzzy"

pytestmark = pytest.mark.slow


def test_password_never_leaks(pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    from hpsearch.tracking.server import start_local_server
    from mlflow.tracking import MlflowClient

    scheme, rest = pg_url.split("://", 1)
    url = f"{scheme}://postgres:{SECRET}@{rest.split('@', 1)[1]}"
    work = tmp_path / "w"
    outputs = []
    r = hpsearch(
        ["launch", "--study", "tiny", "--workers", "2", "--trials", "3", "--storage", url,
         "--workdir", str(work), "--train-fn", DUMMY, "--set", "budget.max_epochs=2"],
        subprocess_env,
    )  # fmt: skip
    outputs += [r.stdout, r.stderr]
    assert r.returncode == 0, r.stdout + r.stderr
    for args in (["status", "--study", "tiny"], ["best", "--study", "tiny", "--json"],
                 ["studies"], ["status", "--study", "ghost"]):  # fmt: skip
        res = hpsearch([*args, "--storage", url], subprocess_env)
        outputs += [res.stdout, res.stderr]
    in_query = f"{scheme}://postgres@{rest.split('@', 1)[1]}?password={SECRET}"  # libpq's
    for args in (["status", "--study", "tiny"], ["status", "--study", "tiny", "--json"]):
        res = hpsearch([*args, "--storage", in_query], subprocess_env)
        assert res.returncode == 0, res.stdout + res.stderr
        outputs += [res.stdout, res.stderr]
    bad = hpsearch(["launch", "--study", "tiny", "--no-tracking", "--storage",
                    url.rsplit("/", 1)[0] + "/no_such_db", "--workdir", str(work)], subprocess_env)  # fmt: skip
    assert bad.returncode != 0
    outputs += [bad.stdout, bad.stderr]
    assert "***" in bad.stderr  # the URL is shown, redacted

    for text in outputs:
        assert SECRET not in text
    # Every file the run produced: journal, logs, resolved study, MLflow store and artifacts.
    scanned = 0
    for path in work.rglob("*"):
        if path.is_file():
            scanned += 1
            assert SECRET.encode() not in path.read_bytes(), path
    assert scanned > 5

    with start_local_server(work) as server:
        client = MlflowClient(server.url)
        exp = client.get_experiment_by_name("tiny")
        assert exp is not None
        runs = client.search_runs([exp.experiment_id])
        assert len(runs) == 4
        for run in runs:
            blob = repr(run.data.params) + repr(run.data.tags) + repr(run.info)
            assert SECRET not in blob
        parent = next(r for r in runs if r.data.tags.get("hpsearch.role") == "study")
        assert "***" in parent.data.tags["hpsearch.storage"]
        study_yaml = client.download_artifacts(parent.info.run_id, "study.yaml", str(tmp_path))
        assert SECRET not in Path(study_yaml).read_text()


def test_a_tracking_password_is_in_no_output_and_no_workers_command_line(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A tracking server behind basic auth (`http://user:password@host`): the launch's last
    line shows the URI masked, without the embedded server's `hpsearch ui` hint, and its
    workers get the URI in their environment, not in their argv (`ps` shows argv)."""
    import subprocess
    import sys
    import time

    from hpsearch.tracking.server import start_local_server
    from mlflow.tracking import MlflowClient

    with start_local_server(tmp_path / "server") as server:
        url = server.url.replace("http://", f"http://bob:{SECRET}@")  # the server ignores it
        launch = subprocess.Popen(
            [sys.executable, "-m", "hpsearch.cli", "launch", "--study", "tiny", "--workers",
             "2", "--trials", "2", "--storage", pg_url, "--workdir", str(tmp_path / "w"),
             "--train-fn", DUMMY, "--tracking-uri", url, "--set", "name=secret-uri",
             "--set", "budget.max_epochs=2"],
            env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        argvs: list[str] = []
        while launch.poll() is None:
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:  # the process ended meanwhile
                    continue
                if "hpsearch.cli worker" in text:
                    argvs.append(text)
            time.sleep(0.05)
        out, err = launch.communicate()
        assert launch.returncode == 0, out + err
        assert argvs and not any(SECRET in a for a in argvs)
        assert SECRET not in out + err
        assert f"MLflow: http://bob:***@127.0.0.1:{server.port}" in out
        assert "hpsearch ui" not in out
        exp = MlflowClient(server.url).get_experiment_by_name("secret-uri")
        assert exp is not None
        trial_runs = MlflowClient(server.url).search_runs(
            [exp.experiment_id], "tags.`hpsearch.role` = 'trial'"
        )
        assert len(trial_runs) == 2  # the workers logged there, through the environment


def test_tracking_password_never_in_errors_or_warnings(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MLflow 3's errors hold the whole tracking URI, password included ("API request to
    http://bob:<password>@host/... failed"): real requests to a port where nothing listens,
    made by each path that reports them, show it masked."""
    import logging
    import traceback

    import hpsearch as hps
    from hpsearch.errors import TrackingError
    from hpsearch.runs import TrackingSession, mark_run_failed
    from hpsearch.storage import resolve_storage
    from hpsearch.tracking.mlflow_logger import TrialTracker, apply_http_policy, ensure_experiment
    from hpsearch.tracking.server import free_port, scrub
    from mlflow import MlflowClient
    from optuna.trial import create_trial

    apply_http_policy()  # MLflow's short HTTP retries
    caplog.set_level(logging.INFO, logger="hpsearch")
    url = f"http://bob:{SECRET}@127.0.0.1:{free_port()}"
    dead = MlflowClient(tracking_uri=url)

    # The launcher's study-level calls: a TrackingError, its traceback included.
    with pytest.raises(TrackingError) as info:
        ensure_experiment(dead, "x")
    shown = "".join(traceback.format_exception(info.value))
    assert "http://bob:***@127.0.0.1" in shown and SECRET not in shown

    # The warnings of a worker's session, a trial's run and the launcher's clean-up.
    cfg = hps.load_config("tiny", ["name=secrets"])
    TrackingSession(cfg, resolve_storage(pg_url, tmp_path), url, "w0").close()
    tracker = TrialTracker(dead, "0", "parent", trial_number=3, study_name="s", params={},
                           worker="w0", start_timeout_s=1.0)  # fmt: skip
    assert not tracker.enabled
    mark_run_failed(url, create_trial(value=0.5, user_attrs={"mlflow_run_id": "abc"}), "failed")
    # A raw exception logged by code that does not scrub it (search.worker's warnings).
    try:
        dead.get_run("abc")
    except Exception as exc:
        assert SECRET in str(exc)  # MLflow's own text: what the scrubbing is for
        logging.getLogger("hpsearch.tracking").warning("trial 3: no MLflow run: %s", exc)
        logging.getLogger("hpsearch.tracking").exception("with its traceback")
    assert scrub(f"to {url}/api failed") == f"to {url.replace(SECRET, '***')}/api failed"

    text = caplog.text + "".join(r.getMessage() for r in caplog.records)
    for needle in ("MLflow at http://bob:***@", "could not mark MLflow run abc", "no MLflow run",
                   "could not create the run of trial 3"):  # fmt: skip
        assert needle in text
    assert "http://bob:***@127.0.0.1" in text
    assert SECRET not in text
