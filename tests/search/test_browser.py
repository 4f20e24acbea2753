"""What a person sees: the MLflow UI and optuna-dashboard of a study run on the native stack
(see tests/stack_util.py), in headless Debian Chromium driven by Playwright.

Screenshots go to each test's tmp_path (``pytest --basetemp DIR`` keeps them somewhere known).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from hpsearch.tracking.server import free_port
from stack_util import (
    StackStudy,
    experiment_by_name,
    run_turn,
    search_runs,
    tags_of,
    worker_env,
)

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("HPSEARCH_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
WAIT_MS = 90_000  # 2 busy cores: the MLflow UI bundle alone takes seconds to parse


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} not found: run .ci/install (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, tmp_path: Path) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(WAIT_MS)
    pg.set_default_navigation_timeout(WAIT_MS)
    try:
        yield pg
    finally:
        # The last state of the page, whatever happened (a failing wait shows what was there).
        try:
            pg.screenshot(path=str(tmp_path / "final.png"), full_page=True)
        except Exception as exc:  # a crashed page must not hide the test's own error
            print(f"final screenshot failed: {exc}")
        ctx.close()


def shot(pg: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0
    return path


def _trial_runs(stack: StackStudy) -> tuple[str, list[dict[str, Any]]]:
    exp_id = experiment_by_name(stack.url, stack.study)["experiment_id"]
    runs = [r for r in search_runs(stack.url, exp_id) if tags_of(r).get("hpsearch.role") == "trial"]
    return str(exp_id), runs


def _best_trial(stack: StackStudy) -> optuna.trial.FrozenTrial:
    return optuna.load_study(study_name=stack.study, storage=stack.storage).best_trial


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    w, h = struct.unpack(">II", head[16:24])
    return int(w), int(h)


# --------------------------------------------------------------------------- MLflow UI


def test_mlflow_lists_the_study_experiment(stack: StackStudy, page: Any, tmp_path: Path) -> None:
    page.goto(f"{stack.url}/#/experiments")
    page.get_by_role("link", name=stack.study, exact=True).first.wait_for()
    shot(page, tmp_path, "experiments")


def test_mlflow_shows_every_trial_run(stack: StackStudy, page: Any, tmp_path: Path) -> None:
    exp_id, runs = _trial_runs(stack)
    trials = optuna.load_study(study_name=stack.study, storage=stack.storage).trials
    assert len(runs) == len(trials) == stack.n_trials
    page.goto(f"{stack.url}/#/experiments/{exp_id}/runs")
    # The parent run of the study plus one child run per trial.
    page.get_by_text(f"{len(trials) + 1} matching runs").wait_for()
    page.get_by_role("link", name=stack.study, exact=True).first.wait_for()
    # Child runs are folded under their parent: unfold it.
    page.locator(".ag-row button[data-component-id*='runnamecellrenderer']").first.click()
    for t in trials:
        page.get_by_role("link", name=f"trial-{t.number}", exact=True).wait_for()
    shot(page, tmp_path, "runs")
    names = [n.strip() for n in page.locator(".ag-row a").all_inner_texts()]
    assert sorted(n for n in names if n.startswith("trial-")) == sorted(
        f"trial-{t.number}" for t in trials
    ), names


def test_mlflow_metric_page_shows_val_acc(stack: StackStudy, page: Any, tmp_path: Path) -> None:
    exp_id, _ = _trial_runs(stack)
    best = _best_trial(stack)
    run_id = str(best.user_attrs["mlflow_run_id"])
    logged = {m["key"]: m for m in run_metrics(stack, run_id)}
    assert "val_acc" in logged, logged
    # The route the UI builds for a metric (getMetricPageRoute in MLflow 3's bundle).
    query = (
        f'?runs=["{run_id}"]&metric=%22val_acc%22&experiments=["{exp_id}"]'
        "&plot_metric_keys=%5B%22val_acc%22%5D&plot_layout={}&x_axis=step&y_axis_scale=linear"
        "&line_smoothness=1&show_point=true&deselected_curves=[]&last_linear_y_axis_range=[]"
    )
    page.goto(f"{stack.url}/#/metric/{query}")
    page.get_by_role("heading", name="val_acc", level=2).wait_for()
    step = int(logged["val_acc"]["step"])
    row = page.get_by_role("row").filter(has_text=f"(step={step})").first
    row.wait_for()
    cells = row.inner_text().split("\t")
    assert cells[0].strip() == "val_acc", cells
    latest = float(cells[1].split("(")[0])
    assert latest == pytest.approx(float(logged["val_acc"]["value"]), abs=1e-6), cells
    assert latest == pytest.approx(float(best.value), abs=1e-6)
    # The chart: a plotly plot whose legend names the run.
    card = page.get_by_test_id("experiment-view-compare-runs-card").first
    card.locator(".js-plotly-plot").first.wait_for(state="visible")
    card.get_by_text(f"trial-{best.number}", exact=True).first.wait_for()
    shot(page, tmp_path, "metric-val_acc")


def run_metrics(stack: StackStudy, run_id: str) -> list[dict[str, Any]]:
    url = f"{stack.url}/api/2.0/mlflow/runs/get?run_id={run_id}"
    with urllib.request.urlopen(url, timeout=30) as resp:
        return list(json.loads(resp.read())["run"]["data"].get("metrics", []))


def test_mlflow_artifacts_tab_shows_the_confusion_matrix(
    stack: StackStudy, page: Any, tmp_path: Path
) -> None:
    exp_id, _ = _trial_runs(stack)
    best = _best_trial(stack)
    run_id = str(best.user_attrs["mlflow_run_id"])
    page.goto(f"{stack.url}/#/experiments/{exp_id}/runs/{run_id}/artifacts/confusion_matrix.png")
    page.get_by_text("learning_curve.png").first.wait_for()
    page.get_by_text(
        f"mlflow-artifacts:/{exp_id}/{run_id}/artifacts/confusion_matrix.png"
    ).wait_for()
    # The preview: an <img> fed from the artifact proxy, decoded by the browser.
    page.wait_for_function(
        "() => [...document.images].some(i => i.src.startsWith('blob:') && i.complete"
        " && i.naturalWidth > 0)",
        timeout=WAIT_MS,
    )
    sizes = page.evaluate(
        "() => [...document.images].filter(i => i.src.startsWith('blob:'))"
        ".map(i => [i.naturalWidth, i.naturalHeight])"
    )
    on_disk = next(stack.artifacts_dir.rglob(f"{run_id}/artifacts/confusion_matrix.png"))
    assert list(_png_size(on_disk)) in sizes, sizes
    shot(page, tmp_path, "artifacts-confusion_matrix")


# --------------------------------------------------------------------------- optuna-dashboard


@pytest.fixture(scope="module")
def dashboard(stack: StackStudy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("dashboard") / "dashboard.log"
    url = f"http://127.0.0.1:{port}"
    # Started within a turn: an exclusive test on another test process stops PostgreSQL,
    # and the dashboard's start then failed ("server closed the connection unexpectedly").
    with run_turn(), open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpsearch.cli", "dashboard", "--storage", stack.optuna_url,
             "--port", str(port)],
            env=worker_env(), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        up = _wait_up(proc, url)
    try:
        if not up:
            pytest.fail(f"hpsearch dashboard did not start: {log.read_text()[-2000:]}")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def _wait_up(proc: subprocess.Popen[bytes], url: str) -> bool:
    """Whether the dashboard answers within 120 s (False once it exits)."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/api/studies", timeout=5) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def test_optuna_dashboard_shows_the_study_and_its_trials(
    stack: StackStudy, dashboard: str, page: Any, tmp_path: Path
) -> None:
    with urllib.request.urlopen(f"{dashboard}/api/studies", timeout=30) as resp:
        summaries = json.loads(resp.read())["study_summaries"]
    ids = {s["study_name"]: s["study_id"] for s in summaries}
    assert stack.study in ids, summaries
    page.goto(f"{dashboard}/dashboard")
    page.get_by_text(stack.study, exact=False).first.wait_for()
    shot(page, tmp_path, "dashboard-studies")
    page.goto(f"{dashboard}/dashboard/studies/{ids[stack.study]}/trials")
    page.get_by_text(f"{stack.n_trials} Trials", exact=True).wait_for()
    for number in range(stack.n_trials):
        page.get_by_text(f"Trial {number}", exact=True).first.wait_for()
    shot(page, tmp_path, "dashboard-trials")
