"""A native stand-in for the team stack (docker-compose.yml) without Docker: two PostgreSQL
databases on the local server (Optuna and MLflow), a real ``mlflow server`` on the MLflow one
with proxied artifacts, and ``hpsearch worker`` processes that join it as separate "hosts".

Used by tests/search/test_stack.py and tests/search/test_browser.py. The expensive part (a
small study trained by two workers with the real trainer) is shared by both modules through
:func:`acquire_study` / :func:`release_study`: the first caller builds it, the last one to
release it tears it down.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsearch.tracking.server import SERVER_ENV, LocalServer, free_port, health_ok

PG_ADMIN = os.environ.get("HPSEARCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
TESTS = Path(__file__).resolve().parent
STUDY = "tiny"
# By path, so that the workers (running in their own folders) read this checkout's file
# whatever copy of the shipped studies the installed package would find.
STUDY_FILE = TESTS.parent / "studies" / f"{STUDY}.yaml"
N_TRIALS = 4
WORKERS = ("hostA", "hostB")
# The real trainer, cut down so that a trial takes seconds on 2 busy CPU cores: one epoch on
# 204 training images (a fixed random subset), 102 validation images, 32 px.
REAL_OVERRIDES = ("budget.max_epochs=1", "dataset.train_limit=204", "dataset.eval_limit=102")
SERVER_START_TIMEOUT_S = 180.0


# --------------------------------------------------------------------------- databases


def _admin_engine() -> Any:
    import sqlalchemy as sa
    from hpsearch.storage import normalize_url

    # NullPool: a test may restart PostgreSQL, which kills pooled connections.
    return sa.create_engine(
        normalize_url(PG_ADMIN), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )


def create_database(prefix: str) -> str:
    """A fresh database on the local server; returns its plain ``postgresql://`` URL."""
    import sqlalchemy as sa

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    eng = _admin_engine()
    try:
        with eng.connect() as c:
            c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        eng.dispose()
    return f"{PG_ADMIN.rsplit('/', 1)[0]}/{name}"


def drop_database(url: str) -> None:
    import sqlalchemy as sa

    name = url.rsplit("/", 1)[1]
    eng = _admin_engine()
    try:
        with eng.connect() as c:
            c.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"
                ),
                {"n": name},
            )
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    finally:
        eng.dispose()


# --------------------------------------------------------------------------- mlflow server


def mlflow_server_command(backend_uri: str, artifacts: Path, port: int) -> list[str]:
    """What the compose file's ``mlflow`` service runs: a PostgreSQL backend store and
    artifacts proxied by the server (``mlflow-artifacts:/`` URIs for every client)."""
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", backend_uri,
        "--serve-artifacts",
        "--artifacts-destination", str(artifacts),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--workers", "1",
        "--uvicorn-opts", "--timeout-graceful-shutdown 5 --no-access-log",
    ]  # fmt: skip


def start_mlflow_server(backend_uri: str, root: Path) -> LocalServer:
    """``mlflow server`` in its own process group (stop() kills the whole group); artifacts go
    to ``root/server-artifacts``, its log to ``root/mlflow-server.log``."""
    artifacts = root / "server-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    log_path = root / "mlflow-server.log"
    port = free_port()
    env = {**os.environ, **SERVER_ENV}
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            mlflow_server_command(backend_uri, artifacts, port),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            cwd=str(root), start_new_session=True,
        )  # fmt: skip
    server = LocalServer(proc, f"http://127.0.0.1:{port}", root, log_path)
    t0 = time.monotonic()
    while not health_ok(server.url):
        if proc.poll() is not None or time.monotonic() - t0 > SERVER_START_TIMEOUT_S:
            server.stop()
            raise RuntimeError(f"mlflow server did not become healthy: {server.log_tail(2000)}")
        time.sleep(0.5)
    server.started_s = time.monotonic() - t0
    return server


# --------------------------------------------------------------------------- REST helpers


def api(base: str, endpoint: str, payload: dict[str, Any] | None = None, **query: Any) -> Any:
    """GET (query params) or POST (JSON payload) on the MLflow REST API; parsed JSON."""
    url = f"{base}/api/2.0/mlflow/{endpoint}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read().decode())


def experiment_by_name(base: str, name: str) -> dict[str, Any]:
    return dict(api(base, "experiments/get-by-name", experiment_name=name)["experiment"])


def search_runs(base: str, experiment_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        body: dict[str, Any] = {"experiment_ids": [experiment_id], "max_results": 1000}
        if token:
            body["page_token"] = token
        page = api(base, "runs/search", body)
        out += page.get("runs", [])
        token = page.get("next_page_token")
        if not token:
            return out


def tags_of(run: dict[str, Any]) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


def list_artifacts(base: str, run_id: str, path: str = "") -> list[dict[str, Any]]:
    query = {"run_id": run_id, **({"path": path} if path else {})}
    return list(api(base, "artifacts/list", **query).get("files", []))


# --------------------------------------------------------------------------- the study


@dataclass
class StackStudy:
    """A study trained on the native stack by two independent workers."""

    root: Path
    optuna_url: str
    mlflow_db_url: str
    server: LocalServer
    workdirs: dict[str, Path]
    logs: dict[str, Path]
    returncodes: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    study: str = STUDY
    n_trials: int = N_TRIALS

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def storage(self) -> str:
        """The Optuna URL with its driver, for optuna.load_study in the test process."""
        from hpsearch.storage import normalize_url

        return str(normalize_url(self.optuna_url))

    @property
    def mlflow_db(self) -> str:
        """The MLflow server's database URL, with its driver."""
        from hpsearch.storage import normalize_url

        return str(normalize_url(self.mlflow_db_url))

    @property
    def artifacts_dir(self) -> Path:
        return self.root / "server-artifacts"

    def log_text(self, worker: str) -> str:
        return self.logs[worker].read_text(errors="replace")


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in ("HPSEARCH_STORAGE", "MLFLOW_TRACKING_URI", "HPSEARCH_WORKDIR"):
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    # Two workers share 2 cores: one thread each instead of 2 x 2 fighting over them.
    env["OMP_NUM_THREADS"] = "1"
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    env["DO_NOT_TRACK"] = "true"
    return env


def worker_args(stack: StackStudy, worker: str, data_dir: Path,
                extra: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    args = [
        "worker", "--study", str(STUDY_FILE),
        "--storage", stack.optuna_url,
        "--tracking-uri", stack.url,
        "--worker-id", worker,
        "--trials", str(stack.n_trials),
        # Each "host" takes its half, so both show up even when one starts faster.
        "--max-trials", str(stack.n_trials // len(WORKERS)),
        "--workdir", str(stack.workdirs[worker]),
        "--data-dir", str(data_dir),
        "--device", "cpu",
    ]  # fmt: skip
    for item in REAL_OVERRIDES:
        args += ["--set", item]
    return [*args, *extra]


def run_workers(stack: StackStudy, data_dir: Path, timeout_s: float = 420.0,
                extra: tuple[str, ...] = ()) -> None:  # fmt: skip
    """Start both workers at once (each its own process, workdir and id: two "hosts") and
    wait for both to exit; fills ``stack.returncodes`` and ``stack.timings['workers_s']``."""
    env = worker_env()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    t0 = time.monotonic()
    try:
        for w in WORKERS:
            stack.workdirs[w].mkdir(parents=True, exist_ok=True)
            with open(stack.logs[w], "wb") as fh:
                procs[w] = subprocess.Popen(
                    [sys.executable, "-m", "hpsearch.cli", *worker_args(stack, w, data_dir, extra)],
                    env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=str(stack.workdirs[w]),
                    start_new_session=True,
                )  # fmt: skip
        for w, p in procs.items():
            left = max(1.0, timeout_s - (time.monotonic() - t0))
            stack.returncodes[w] = p.wait(timeout=left)
    finally:
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
                p.wait(timeout=10)
        stack.timings["workers_s"] = time.monotonic() - t0


def init_schema(optuna_url: str) -> None:
    """What the compose file's one-shot ``optuna-schema`` service does before any worker
    starts: create Optuna's tables once (workers starting together on an empty database race
    on ``CREATE TYPE``)."""
    done = subprocess.run(
        [sys.executable, "-m", "hpsearch.cli", "studies", "--storage", optuna_url],
        env=worker_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0 or "no studies" not in done.stdout:
        raise RuntimeError(f"hpsearch studies failed: {done.stdout}{done.stderr}")


@contextlib.contextmanager
def stack_study(root: Path, data_dir: Path) -> Iterator[StackStudy]:
    """Databases + server + a study run by two workers; everything removed on exit."""
    root.mkdir(parents=True, exist_ok=True)
    optuna_url = create_database("hps_optuna")
    mlflow_db = create_database("hps_mlflow")
    server: LocalServer | None = None
    try:
        t0 = time.monotonic()
        server = start_mlflow_server(mlflow_db.replace("postgresql://", "postgresql+psycopg2://", 1),
                                     root)  # fmt: skip
        stack = StackStudy(
            root=root,
            optuna_url=optuna_url,
            mlflow_db_url=mlflow_db,
            server=server,
            workdirs={w: root / f"{w}-work" for w in WORKERS},
            logs={w: root / f"{w}.log" for w in WORKERS},
        )
        stack.timings["server_start_s"] = time.monotonic() - t0
        init_schema(optuna_url)
        run_workers(stack, data_dir)
        yield stack
    finally:
        if server is not None:
            server.stop()
        drop_database(mlflow_db)
        drop_database(optuna_url)


_SHARED: dict[str, Any] = {"count": 0, "cm": None, "stack": None}


def acquire_study(make_root: Callable[[], Path], data_dir: Path) -> StackStudy:
    """The shared study (built on first use, under the folder ``make_root()`` returns)."""
    if _SHARED["stack"] is None:
        cm = stack_study(make_root(), data_dir)
        _SHARED["stack"] = cm.__enter__()
        _SHARED["cm"] = cm
    _SHARED["count"] += 1
    return _SHARED["stack"]  # type: ignore[no-any-return]


def release_study() -> None:
    _SHARED["count"] -= 1
    if _SHARED["count"] <= 0 and _SHARED["cm"] is not None:
        cm = _SHARED["cm"]
        _SHARED.update(count=0, cm=None, stack=None)
        cm.__exit__(None, None, None)


@contextlib.contextmanager
def fake_mlflow(
    api_status: int, hang: threading.Event | None = None, health_status: int = 200
) -> Iterator[str]:
    """An HTTP server that answers /health with `health_status` (MLflow 3 checks neither
    the Host header nor the login there: 200) and every API call with `api_status`, or
    holds it until `hang` is set. Yields its URL."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            if not self.path.startswith("/health") and hang is not None:
                hang.wait(60)
                return
            status = health_status if self.path.startswith("/health") else api_status
            body = (
                b"OK" if status == 200
                else b'{"error_code": "PERMISSION_DENIED"}' if status in (401, 403)
                else b"<html>Not Found</html>"  # a proxy's own page
            )  # fmt: skip
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        if hang is not None:
            hang.set()
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def turn_for_test(base: Path, exclusive: bool) -> Iterator[None]:
    """A test's turn among the test processes of one run: shared, or alone (`exclusive`).
    A readers-writer lock on `<base>.lock` with a gate, `<base>.gate`, so that the
    exclusive one is not starved: it takes the gate, which new tests pass only briefly,
    then waits for the running tests to end."""
    import fcntl

    with open(f"{base}.gate", "a") as gate, open(f"{base}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)


@contextlib.contextmanager
def run_turn(exclusive: bool = False) -> Iterator[None]:
    """`turn_for_test` among this run's pytest-xdist processes; nothing without xdist. For
    fixtures broader than one test that use PostgreSQL while they are set up (the shared
    stack): a test's own turn (tests/conftest.py) begins only after them."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:  # one test process: nothing runs beside a test
        yield
        return
    import tempfile

    with turn_for_test(Path(tempfile.gettempdir()) / f"hpsearch-tests-{run}", exclusive):
        yield
