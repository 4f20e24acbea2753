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
