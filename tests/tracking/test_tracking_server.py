"""The local MLflow server: pure helpers, and a real start / stop / restart cycle."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cli_util import group_alive
from hpsearch.errors import TrackingError
from hpsearch.tracking import server as srv
from hpsearch.tracking.server import (
    allowed_hosts_for,
    attach_or_start,
    one_line,
    redact_uri,
    resolve_tracking_uri,
    running_server_url,
    scrub,
    serve_ui,
    server_command,
    start_local_server,
    state_path,
    store_paths,
    ui_command,
)
from mlflow import MlflowClient
from tracking_helpers import group_members

# --------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("cli", "env", "expected"),
    [
        ("http://cli:5000", {"MLFLOW_TRACKING_URI": "http://env:5000"}, "http://cli:5000"),
        (None, {"MLFLOW_TRACKING_URI": "http://env:5000"}, "http://env:5000"),
        ("  ", {"MLFLOW_TRACKING_URI": "http://env:5000"}, "http://env:5000"),
        (None, {"MLFLOW_TRACKING_URI": ""}, None),
        (None, {}, None),
    ],
)
def test_resolve_tracking_uri_precedence(
    cli: str | None, env: dict[str, str], expected: str | None
) -> None:
    assert resolve_tracking_uri(cli, env) == expected


def test_a_tracking_uri_without_a_scheme_is_refused_with_its_token_hidden() -> None:
    with pytest.raises(TrackingError, match=r"no scheme; give http://h:5000/x\?token=\*") as err:
        resolve_tracking_uri("h:5000/x?token=s3cret")
    assert "s3cret" not in str(err.value)


def test_resolve_tracking_uri_reads_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://from-env:1")
    assert resolve_tracking_uri(None) == "http://from-env:1"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert resolve_tracking_uri(None) is None


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (
            "postgresql://optuna:s3cr%40t@db.example:5432/optuna",
            "postgresql://optuna:***@db.example:5432/optuna",
        ),
        (
            "postgresql+psycopg2://u:p@h/db?sslmode=require",
            "postgresql+psycopg2://u:***@h/db?sslmode=require",
        ),
        ("http://alice:pw@mlflow:5000", "http://alice:***@mlflow:5000"),
        ("https://token@host/api", "https://token@host/api"),  # user only: nothing to hide
        ("postgresql://h/db?user=u&password=pw", "postgresql://h/db?user=u&password=***"),
        ("sqlite:///abs/path/optuna.db", "sqlite:///abs/path/optuna.db"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("not a url", "not a url"),
        ("postgresql://u:p@h:notaport/db", "postgresql://u:***@h:notaport/db"),
    ],
)
def test_redact_uri(uri: str, expected: str) -> None:
    assert redact_uri(uri) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "API request to http://bob:S3CRET@127.0.0.1:9/api/2.0/mlflow/runs/get failed",
            "API request to http://bob:***@127.0.0.1:9/api/2.0/mlflow/runs/get failed",
        ),
        # A raw "@" in the password: masked up to the host's "@"; a later "@" is the path's.
        ("'https://u:p@ss@h:1/x?e=a@b'", "'https://u:***@h:1/x?e=a@b'"),
        (
            "a http://a:b@c and postgresql://d:e@f/db",
            "a http://a:***@c and postgresql://d:***@f/db",
        ),
        (
            "see postgresql://h/db?user=u&password=pw now",
            "see postgresql://h/db?user=u&password=*** now",
        ),
        ("http://127.0.0.1:5000/a@b", "http://127.0.0.1:5000/a@b"),  # no user: nothing to hide
        ("https://token@host/api", "https://token@host/api"),
        ("no url at all", "no url at all"),
    ],
)
def test_scrub_masks_credentials_of_urls_inside_text(text: str, expected: str) -> None:
    assert scrub(text) == expected


def test_a_tracking_uri_mlflow_keeps_no_runs_under_is_refused_and_its_own_forms_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`htp://` trained untracked; MLflow's own `databricks` and a plugin's scheme (review:
    refused as a folder, as unknown) are taken. No server is asked (`answer=False`)."""
    from hpsearch.tracking.server import check_tracking_uri

    for uri in ("databricks", "databricks://team", "sqlite:////tmp/x.db",
                "postgresql+psycopg2://u@h/db", "http://127.0.0.1:9"):  # fmt: skip
        check_tracking_uri(uri, answer=False)
    with pytest.raises(TrackingError, match=r"MLflow keeps no runs under htp://"):
        check_tracking_uri("htp://host:5000", answer=False)
    with pytest.raises(TrackingError, match=r"a folder, which MLflow 3 keeps no new runs"):
        check_tracking_uri("mlruns", answer=False)
    with pytest.raises(TrackingError, match=r"under azureml://"):
        check_tracking_uri("azureml://ws", answer=False)
    monkeypatch.setattr(srv, "_plugin_schemes", lambda: {"azureml"})  # a plugin installed
    check_tracking_uri("azureml://ws", answer=False)


def test_the_log_scrubber_never_raises_into_the_code_that_logs() -> None:
    """A logger's filter runs outside its handlers' error handling: a record it cannot
    format must go on to them (which report it) rather than raise in a best-effort path."""
    import logging

    def record(msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("hpsearch.tracking", logging.WARNING, __file__, 1, msg, args, None)

    bad = record("%s and %s", "only one argument")
    assert srv.ScrubFilter().filter(bad) and bad.msg == "%s and %s"  # passed on as it is
    clean = record("at %s", "x://u:p@h")
    assert srv.ScrubFilter().filter(clean) and clean.getMessage() == "at x://u:***@h"


def test_server_command_uses_sqlite_store_and_proxied_artifacts(tmp_path: Path) -> None:
    cmd = server_command(tmp_path, "127.0.0.1", 5123)
    db, artifacts, _ = store_paths(tmp_path)
    assert cmd[:4] == [sys.executable, "-m", "mlflow", "server"]
    assert cmd[cmd.index("--backend-store-uri") + 1] == f"sqlite:///{db}"
    assert db == tmp_path.resolve() / "mlflow" / "mlflow.db"
    assert "--serve-artifacts" in cmd
    assert cmd[cmd.index("--artifacts-destination") + 1] == str(artifacts)
    assert cmd[cmd.index("--port") + 1] == "5123"
    assert "--allowed-hosts" not in cmd
    assert "--no-access-log" in cmd[cmd.index("--uvicorn-opts") + 1]


def test_the_embedded_server_ignores_the_users_own_server_settings() -> None:
    """`mlflow server` reads its options from the environment too: a user's
    MLFLOW_STATIC_PREFIX moved /health (the start waited out its time-out) and
    MLFLOW_DEFAULT_ARTIFACT_ROOT took artifacts out of the work folder."""
    base = {
        "MLFLOW_STATIC_PREFIX": "/mlflow",
        "MLFLOW_DEFAULT_ARTIFACT_ROOT": "s3://bucket/x",
        "MLFLOW_TRACKING_URI": "http://elsewhere:5000",
        "MLFLOW_TRACKING_USERNAME": "kept",  # a client setting: harmless, kept
        "PATH": "/usr/bin",
    }
    env = srv.server_env(base)
    assert "MLFLOW_STATIC_PREFIX" not in env and "MLFLOW_DEFAULT_ARTIFACT_ROOT" not in env
    assert "MLFLOW_TRACKING_URI" not in env
    assert env["MLFLOW_TRACKING_USERNAME"] == "kept" and env["PATH"] == "/usr/bin"
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    # every option `mlflow server` reads from the environment, in the installed MLflow
    import mlflow.cli

    options = {str(p.envvar) for p in mlflow.cli.server.params if p.envvar}
    assert options <= set(srv.SERVER_OPTION_ENV), options - set(srv.SERVER_OPTION_ENV)


def test_allowed_hosts_only_for_non_loopback_binds() -> None:
    assert allowed_hosts_for("127.0.0.1", 5000) is None
    assert allowed_hosts_for("localhost", 5000) is None
    value = allowed_hosts_for("0.0.0.0", 5000, ("gpubox", "gpubox.lab"))
    assert value is not None
    hosts = value.split(",")
    assert {"gpubox", "gpubox:5000", "gpubox.lab:5000", "localhost:*", "10.*"} <= set(hosts)
    assert "0.0.0.0" not in hosts
    ui = ui_command(Path("/w"), "0.0.0.0", 5000)
    assert "--allowed-hosts" in ui
    # An IPv6 bind: the URL printed brackets the address, and so does the Host header
    from mlflow.server.security_utils import is_allowed_host_header

    six = (allowed_hosts_for("fd00::5", 5000) or "").split(",")
    assert is_allowed_host_header(six, "[fd00::5]:5000")  # was refused: unbracketed only
    assert not is_allowed_host_header(six, "[2001:db8::6]:5000")  # a public one: no
    every = (allowed_hosts_for("::", 5000) or "").split(",")  # private IPv6 clients of "::"
    assert is_allowed_host_header(every, "[fd00::7]:5000")


def test_running_server_url_ignores_stale_or_broken_state(tmp_path: Path) -> None:
    assert running_server_url(tmp_path) is None
    state_path(tmp_path).parent.mkdir(parents=True)
    state_path(tmp_path).write_text("{not json")
    assert running_server_url(tmp_path) is None
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    state_path(tmp_path).write_text(f'{{"url": "http://127.0.0.1:9", "pid": {dead}}}')
    assert running_server_url(tmp_path) is None


def test_one_line() -> None:
    assert one_line("a\n\n b \nc") == "a | b | c"
    assert one_line("x" * 50, limit=10) == "..." + "x" * 10


def test_health_ok_tells_a_server_without_health_from_none(tmp_path: Path) -> None:
    """`launch --tracking-uri` refuses a URL where nothing answers, not one that answers
    404 to /health (a hosted MLflow may not serve it)."""
    import http.server
    import threading

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0),
        functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)),
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert not srv.health_ok(url)  # 404: not an MLflow health check
        assert srv.health_ok(url, any_status=True)
        assert srv.health_ok(url + "/", any_status=True)
    finally:
        httpd.shutdown()
        httpd.server_close()
    closed = srv.free_port()
    assert not srv.health_ok(f"http://127.0.0.1:{closed}", timeout_s=1.0, any_status=True)


# --------------------------------------------------------------------------- failures (fast)


def test_port_in_use_is_a_tracking_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(TrackingError, match=f"on 127.0.0.1:{port}: Address already in use$"):
            start_local_server(tmp_path, port=port)
        # `hpsearch ui` names a port that is free (QA: it only said "in use").
        with pytest.raises(TrackingError, match=r"Address already in use \(--port \d+ is free\)$"):
            serve_ui(tmp_path, port=port)
    # A host that is not this machine's or does not resolve: said so, not "in use".
    with pytest.raises(TrackingError, match=r"on 999.1.1.1:5000: (?!Address already in use)"):
        start_local_server(tmp_path, host="999.1.1.1", port=5000)
    with pytest.raises(TrackingError, match=r"on nosuch.invalid:5000: [^(]*$"):
        serve_ui(tmp_path, host="nosuch.invalid", port=5000)


def test_a_picked_port_taken_before_the_server_binds_it_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`port=None` picks a free port, which another process can take before the server
    binds it: the real server then exits with 'address already in use', and the start
    picks another port instead of failing the launch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        picks = iter([taken, srv.free_port()])
        monkeypatch.setattr(srv, "free_port", lambda host="127.0.0.1": next(picks))
        server = start_local_server(tmp_path)
        try:
            assert server.url.rsplit(":", 1)[1] != str(taken)
            assert srv.health_ok(server.url)
            assert "address already in use" in srv._read_tail(server.log_path).lower()
        finally:
            server.stop()


def test_ctrl_c_while_the_server_starts_leaves_no_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hpsearch ui` interrupted before the server answered: the server (its own session,
    so the terminal's Ctrl-C never reaches it) is stopped, not left holding the port."""
    started: list[srv.LocalServer] = []
    real_stop = srv.LocalServer.stop

    def recording_stop(self: srv.LocalServer, timeout_s: float = 10.0) -> None:
        started.append(self)
        real_stop(self, timeout_s)

    def interrupted(url: str, timeout_s: float = 2.0) -> bool:
        time.sleep(1.0)  # the server process is up by now
        raise KeyboardInterrupt

    monkeypatch.setattr(srv.LocalServer, "stop", recording_stop)
    monkeypatch.setattr(srv, "health_ok", interrupted)
    with pytest.raises(KeyboardInterrupt):
        start_local_server(tmp_path)
    assert len(started) == 1 and not started[0].group_alive()


def test_server_that_dies_reports_its_stderr_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = "import sys; print('line one'); sys.stderr.write('boom: bad store\\n'); sys.exit(3)"
    monkeypatch.setattr(srv, "server_command", lambda *a, **k: [sys.executable, "-c", script])
    with pytest.raises(TrackingError) as info:
        start_local_server(tmp_path, timeout_s=30)
    msg = str(info.value)
    assert "\n" not in msg
    assert "code 3" in msg and "boom: bad store" in msg and "line one" in msg


def test_server_not_healthy_in_time_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A parent that never answers /health and has a child: both must be gone afterwards.
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('starting', flush=True); time.sleep(60)"
    )
    spawned: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)  # type: ignore[call-overload]
        spawned.append(proc)
        return proc

    monkeypatch.setattr(srv, "server_command", lambda *a, **k: [sys.executable, "-c", script])
    monkeypatch.setattr(srv.subprocess, "Popen", popen)
    t0 = time.monotonic()
    with pytest.raises(TrackingError, match=r"not healthy after 2 s: .*starting"):
        start_local_server(tmp_path, timeout_s=2)
    assert time.monotonic() - t0 < 20
    assert spawned and not group_alive(spawned[0].pid)


def test_a_starting_server_is_named_before_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher killed while its server started (tens of seconds, cold) left a server no
    state file named: the next launch started a second writer of the same store, and the
    first ran for good. Now a joiner finds it (and waits for it to answer)."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(srv, "server_command", lambda *a, **k: sleeper)
    path = state_path(tmp_path.resolve())
    seen: list[dict[str, object] | None] = []

    def health(url: str, timeout_s: float = 2.0) -> bool:
        seen.append(json.loads(path.read_text()) if path.exists() else None)
        return True

    monkeypatch.setattr(srv, "health_ok", health)
    server = start_local_server(tmp_path)
    try:
        first = seen[0]
        assert first is not None and first["pid"] == server.pid and first["url"] == server.url
    finally:
        server.stop()
    assert not path.exists()


# --------------------------------------------------------------------------- real server


@pytest.mark.slow
def test_start_health_stop_restart_keeps_runs(tmp_path: Path) -> None:
    workdir = tmp_path / "wd"
    server = start_local_server(workdir)
    try:
        with urllib.request.urlopen(f"{server.url}/health", timeout=5) as resp:
            assert resp.status == 200
        db, artifacts, log = store_paths(workdir)
        assert db.exists() and artifacts.is_dir() and log.exists()
        client = MlflowClient(tracking_uri=server.url)
        exp = client.create_experiment("restart-check")
        run = client.create_run(exp, run_name="before-restart")
        client.log_text(run.info.run_id, "hello", "hello.txt")
        port, pgid = server.port, server.pgid
        assert group_alive(pgid)
        # one writer per store: a second server on the same workdir is refused
        assert running_server_url(workdir) == server.url
        with pytest.raises(TrackingError, match=r"already running at http://127\.0\.0\.1"):
            start_local_server(workdir)
        joined = attach_or_start(workdir)  # the running one, joined as a second user
        assert joined.url == server.url
        assert len(json.loads(state_path(workdir).read_text())["users"]) == 2
        assert joined.release() == "in use"  # its first user (here, this process too) stays
        assert server.is_running()
        children = group_members(pgid)
        assert len(children) >= 2 and server.pid in children  # mlflow CLI + uvicorn (at least)
    finally:
        server.stop()
    assert not group_alive(pgid) and group_members(pgid) == []
    assert running_server_url(workdir) is None and not state_path(workdir).exists()
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
    server.stop()  # idempotent

    with serve_ui(workdir, port=port) as again:  # `hpsearch ui` on the same store
        assert again.url == server.url
        client = MlflowClient(tracking_uri=again.url)
        exp2 = client.get_experiment_by_name("restart-check")
        assert exp2 is not None and exp2.experiment_id == exp
        runs = client.search_runs([exp])
        assert [r.info.run_name for r in runs] == ["before-restart"]
        local = client.download_artifacts(run.info.run_id, "hello.txt", str(tmp_path))
        assert Path(local).read_text() == "hello"
        pgid2 = again.pgid
    assert not group_alive(pgid2)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


_USER = (
    "import sys, time; from pathlib import Path; "
    "from hpsearch.tracking.server import attach_or_start; "
    "s = attach_or_start(Path(sys.argv[1])); print(s.url, flush=True); "
    "sys.stdin.readline(); print(s.release(), flush=True); time.sleep(600)"
)


@pytest.mark.slow
def test_the_stores_server_is_shared_and_the_last_user_to_leave_stops_it(tmp_path: Path) -> None:
    """Two launches (say, two studies) of one work folder: they start at once and get one
    server (one writer of the SQLite file); the first to end leaves it running for the
    other; one killed with SIGKILL does not count; the last user left stops it."""
    import json
    import os
    import signal

    from hpsearch.tracking.server import join_server, store_lock

    users = [
        subprocess.Popen(
            [sys.executable, "-c", _USER, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        urls = [u.stdout.readline().strip() for u in users if u.stdout is not None]
        assert urls[0].startswith("http://") and urls[0] == urls[1]
        pgid = json.loads(state_path(tmp_path).read_text())["pgid"]
        assert len(json.loads(state_path(tmp_path).read_text())["users"]) == 2
        with store_lock(tmp_path):
            here = join_server(tmp_path)
        assert here is not None and here.url == urls[0] and here.shared()
        first, second = users
        assert first.stdin is not None and first.stdout is not None
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.stdout.readline().strip() == "in use"  # the others still use it
        assert group_alive(pgid) and running_server_url(tmp_path) == urls[0]
        os.kill(second.pid, signal.SIGKILL)  # a launch killed mid-study
        second.wait(10)
        first.kill()
        first.wait(10)
        assert group_alive(pgid) and not here.shared()
        assert here.release() == "stopped"  # the last live user
        assert not group_alive(pgid) and not state_path(tmp_path).exists()
    finally:
        for user in users:
            user.kill()
        with contextlib.suppress(Exception):
            os.killpg(json.loads(state_path(tmp_path).read_text())["pgid"], signal.SIGKILL)


@pytest.mark.slow
def test_the_last_user_stops_its_own_server_at_once(tmp_path: Path) -> None:
    server = start_local_server(tmp_path)
    t0 = time.monotonic()
    assert server.release() == "stopped"
    # Its leader reaped as it exits: its zombie kept the group "alive" for 10 s, then SIGKILL.
    assert time.monotonic() - t0 < 8.0
    assert not group_alive(server.pgid) and not state_path(tmp_path).exists()
    assert server.release() == "gone"


def test_leaving_a_server_whose_pid_was_reused_kills_nothing(tmp_path: Path) -> None:
    """server.json names a leader that is gone, its PID (and so its group id) now another
    process's in a session of its own: leaving the server signalled that group."""
    from hpsearch.packing import process_start
    from hpsearch.tracking.server import leave_server

    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # the PID's new owner
    try:
        state_path(tmp_path).parent.mkdir(parents=True)
        started = process_start(other.pid)
        assert started is not None
        state = {"url": "http://127.0.0.1:9", "pid": other.pid, "pgid": other.pid,
                 "users": [], "start": started - 100}  # fmt: skip
        state_path(tmp_path).write_text(json.dumps(state))
        assert leave_server(tmp_path, other.pid, other.pid, timeout_s=1.0) == "gone"
        assert other.poll() is None  # not signalled
    finally:
        other.kill()
        other.wait()


def test_a_live_server_that_does_not_answer_is_not_started_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy server that missed one /health check was taken for dead: a second server
    started on the same SQLite file, and the first ran on with no one to stop it."""
    from hpsearch.packing import process_start
    from hpsearch.tracking.server import join_server

    monkeypatch.setattr(srv, "JOIN_HEALTH_S", 1.0)
    monkeypatch.setattr(srv, "DEFAULT_START_TIMEOUT_S", 3.0)
    mute = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a server not answering
    try:
        state_path(tmp_path).parent.mkdir(parents=True)
        url = f"http://127.0.0.1:{srv.free_port()}"
        state = {"url": url, "pid": mute.pid, "pgid": mute.pid, "users": []}
        state_path(tmp_path).write_text(json.dumps({**state, "start": process_start(mute.pid)}))
        t0 = time.monotonic()
        with pytest.raises(TrackingError, match=rf"\(pid {mute.pid}\) runs but does not answer"):
            join_server(tmp_path)
        # Started moments ago, it may still be starting (its starter killed meanwhile): it
        # gets what is left of the start's limit, not the 1 s a running server gets.
        assert time.monotonic() - t0 >= 1.8
        # The same PID, started at another time: another process, the server is gone.
        state_path(tmp_path).write_text(json.dumps({**state, "start": 1}))
        assert join_server(tmp_path) is None
    finally:
        mute.kill()
        mute.wait()


def test_users_are_live_processes_and_a_file_of_the_version_before_names_its_owner() -> None:
    import os

    from hpsearch.packing import process_start

    me = [os.getpid(), process_start(os.getpid())]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    reused = [os.getpid(), (me[1] or 0) + 1]  # this PID, a process started at another time
    state = {"users": [me, [dead.pid, None], reused, ["x", None], "junk"]}
    assert srv._live_users(state) == [me]
    assert srv._live_users({"owner": me[0], "owner_start": me[1]}) == [me]
    assert srv._live_users({"owner": dead.pid}) == []
    # A file that names no user (two versions before): the server's parent, which started it;
    # none when init adopted it (its starter was killed).
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert srv._live_users({"pid": child.pid}) == [[me[0], None]]
    finally:
        child.kill()
        child.wait()
    assert srv._live_users({"pid": 1}) == []


def test_a_login_in_the_tracking_uri_goes_in_the_health_checks_header() -> None:
    """urllib cannot open `http://user:password@host/...` (MLflow's client sends the login
    as basic auth): the launcher found no server behind basic auth."""
    import base64

    from hpsearch.tracking.server import _request

    req = _request("http://a%40b:p%3Aw@mlflow.example:5000/prefix/")
    assert req.full_url == "http://mlflow.example:5000/prefix/health"
    token = req.get_header("Authorization").removeprefix("Basic ")
    assert base64.b64decode(token).decode() == "a@b:p:w"
    plain = _request("http://127.0.0.1:5000")
    assert plain.full_url == "http://127.0.0.1:5000/health" and not plain.has_header(
        "Authorization"
    )


def test_a_server_restarted_after_it_died_keeps_its_other_users(tmp_path: Path) -> None:
    """A launch restarts its embedded server that died mid-study (the OOM killer): the new
    server's record named the launch alone, so the launch, ending, stopped it under another
    search or `hpsearch ui` still using it. Its other live users stay users, on its port."""
    import json
    import os
    import signal

    from hpsearch.packing import process_start
    from hpsearch.tracking.server import restart_server

    server = start_local_server(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        state = json.loads(state_path(tmp_path).read_text())
        state["users"].append([other.pid, process_start(other.pid)])
        state_path(tmp_path).write_text(json.dumps(state))
        os.killpg(server.pgid, signal.SIGKILL)
        server.proc.wait(10)
        again = restart_server(server)
        assert again is not None and again.url == server.url  # the port its users know
        users = json.loads(state_path(tmp_path).read_text())["users"]
        assert [other.pid, process_start(other.pid)] in users and len(users) == 2
        assert again.release() == "in use"  # the other user keeps it
        assert running_server_url(tmp_path) == server.url
    finally:
        other.kill()
        other.wait(10)
        _kill_store_server(tmp_path)


def test_a_joined_server_whose_starter_was_killed_is_restarted_by_its_user(
    tmp_path: Path,
) -> None:
    """QA: a relaunch after `kill -9` joined the killed launch's server; when that died
    mid-study nobody started it again (only its starter did), and the last trials' runs
    waited on disk for another launch."""
    import os
    import signal

    from hpsearch.tracking.server import LocalServer, SharedServer, join_server, restart_server

    code = (
        "import os, sys; from pathlib import Path; "
        "from hpsearch.tracking.server import start_local_server; "
        "start_local_server(Path(sys.argv[1])); os._exit(0)"  # killed: no clean-up
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=240)
    joined = join_server(tmp_path)
    assert isinstance(joined, SharedServer)
    again: LocalServer | SharedServer | None = None
    try:
        os.killpg(joined.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while joined.is_running() and time.monotonic() < deadline:
            time.sleep(0.1)
        again = restart_server(joined)
        assert isinstance(again, LocalServer) and again.url == joined.url  # its users' URI
        assert srv.health_ok(again.url)
        assert again.release() == "stopped"
    finally:
        _kill_store_server(tmp_path)


def test_a_server_restarted_by_one_launch_is_joined_once_by_the_other_and_stops_with_the_last(
    tmp_path: Path,
) -> None:
    """QA: two launches of one work folder, its server dead mid-study: the launch that
    started it again kept the other as a user, whose own restart then joined it once more.
    Named twice, that one left it "in use" at its end, and the server ran on with no user."""
    import os
    import signal

    from hpsearch.tracking.server import join_server, restart_server

    code = (
        "import sys; from pathlib import Path; "
        "from hpsearch.tracking.server import restart_server, start_local_server; "
        "server = start_local_server(Path(sys.argv[1])); print('up', flush=True); input(); "
        "again = restart_server(server); print('again', flush=True); input(); "
        "print(again.release(), flush=True)"
    )
    starter = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    assert starter.stdin is not None and starter.stdout is not None
    try:
        assert starter.stdout.readline().strip() == "up"
        joined = join_server(tmp_path)
        assert joined is not None
        os.killpg(joined.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while joined.is_running() and time.monotonic() < deadline:
            time.sleep(0.1)
        starter.stdin.write("\n")
        starter.stdin.flush()
        assert starter.stdout.readline().strip() == "again"
        again = restart_server(joined)  # its starter's: joined
        assert again is not None and again.url == joined.url
        users = json.loads(state_path(tmp_path).read_text())["users"]
        assert [u[0] for u in users].count(os.getpid()) == 1, users
        assert again.release() == "in use"  # the starter still uses it
        starter.stdin.write("\n")
        starter.stdin.flush()
        assert starter.stdout.readline().strip() == "stopped"  # the last user to leave
        assert running_server_url(tmp_path) is None
    finally:
        starter.kill()
        starter.wait(10)
        _kill_store_server(tmp_path)


def test_a_best_model_in_the_embedded_store_is_read_from_disk_once_its_server_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded server stops with its launch: load_best_model without a tracking URI
    reads the checkpoint from the store's artifacts folder, in the layout the real server
    writes (`mlflow server --artifacts-destination`)."""
    from hpsearch.runs import download_best_model
    from mlflow.tracking import MlflowClient
    from optuna.trial import create_trial

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # no tracking URI given
    server = start_local_server(tmp_path)
    try:
        client = MlflowClient(server.url)
        run_id = client.create_run(client.create_experiment("embedded-best")).info.run_id
        best = tmp_path / "best.pt"
        best.write_bytes(b"weights")
        client.log_artifact(run_id, str(best), "checkpoint")
    finally:
        assert server.release() == "stopped"
    trial = create_trial(value=0.5, user_attrs={
        "mlflow_run_id": run_id, "checkpoint_uri": f"runs:/{run_id}/checkpoint/best.pt",
    })  # fmt: skip
    found = download_best_model(trial, None, tmp_path, tmp_path / "unused")
    assert found.read_bytes() == b"weights" and not (tmp_path / "unused").exists()


@pytest.mark.slow
def test_ui_on_a_folder_a_search_serves_says_its_port_was_not_used(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """`hpsearch ui --port 5999` on a work folder a launch serves joins that server (one
    writer per SQLite store): it printed the other URL without a word about the port."""
    from cli_util import hpsearch

    server = start_local_server(tmp_path)  # this process: the "search" using it
    try:
        taken = int(server.url.rsplit(":", 1)[1])
        other = taken + 1 if taken < 65535 else taken - 1
        out = hpsearch(["ui", "--workdir", str(tmp_path), "--port", str(other)], subprocess_env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == (
            f"MLflow UI: {server.url} (already served for a running search, worker or train; "
            f"--port {other} not used: one server per work folder's store)"
        )
        out = hpsearch(["ui", "--workdir", str(tmp_path)], subprocess_env)  # the default port
        assert out.stdout.strip() == (
            f"MLflow UI: {server.url} (already served for a running search, worker or train)"
        ), out.stderr
        assert server.is_running()  # left to its user
    finally:
        server.stop()


@pytest.mark.slow
def test_ui_that_takes_over_a_server_left_running_says_its_port_was_not_used(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: `ui --port P` on a work folder whose server a killed search left running joins
    that one, and stops it on Ctrl-C; it said nothing of the port it did not use."""
    import os
    import signal

    from cli_util import popen

    code = (
        "import os, sys; from pathlib import Path; "
        "from hpsearch.tracking.server import start_local_server; "
        "start_local_server(Path(sys.argv[1])); os._exit(0)"  # killed: no clean-up
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=240)
    url = str(json.loads(srv.state_path(tmp_path).read_text())["url"])
    pgid = int(json.loads(srv.state_path(tmp_path).read_text())["pgid"])
    other = srv.free_port()
    log = tmp_path / "ui.log"
    ui = popen(["ui", "--workdir", str(tmp_path), "--port", str(other)], subprocess_env, log)
    try:
        deadline = time.monotonic() + 120
        while "MLflow UI" not in log.read_text():
            assert ui.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert log.read_text().strip() == (
            f"MLflow UI: {url} (Ctrl-C to stop; --port {other} not used: one server per work "
            "folder's store)"
        )
        ui.send_signal(signal.SIGINT)
        assert ui.wait(timeout=60) == 130, log.read_text()
        deadline = time.monotonic() + 30
        while group_alive(pgid):  # its last user, it stopped the server
            assert time.monotonic() < deadline, f"server group {pgid} left running"
            time.sleep(0.1)
    finally:
        if ui.poll() is None:
            ui.kill()
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


@pytest.mark.slow
def test_ui_stopped_while_its_server_starts_stops_that_server(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: `hpsearch ui` given SIGTERM or SIGHUP during its server's start (15 s on a loaded
    machine) died at once and left the MLflow server running on its port. Stopped then, or
    once serving, it stops its server and exits 143, as launch, worker and train do."""
    import signal

    from cli_util import popen

    log = tmp_path / "ui.log"
    port = str(srv.free_port())
    ui = popen(["ui", "--workdir", str(tmp_path), "--port", port], subprocess_env, log)
    try:
        state = srv.state_path(tmp_path)
        deadline = time.monotonic() + 120
        while not state.exists():  # written as the server is spawned, before it answers
            assert ui.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        pgid = int(json.loads(state.read_text())["pgid"])
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(timeout=60) == 143, log.read_text()
    finally:
        if ui.poll() is None:
            ui.kill()
    deadline = time.monotonic() + 30
    while group_alive(pgid):
        assert time.monotonic() < deadline, f"server group {pgid} left running"
        time.sleep(0.1)


def _kill_store_server(workdir: Path) -> None:
    """Clean-up: SIGKILL the process group of the server `server.json` names, if any."""
    import os
    import signal

    with contextlib.suppress(Exception):
        os.killpg(int(json.loads(state_path(workdir).read_text())["pgid"]), signal.SIGKILL)


def test_the_servers_last_error_is_read_from_this_starts_part_of_its_log(tmp_path: Path) -> None:
    """QA: the work folder's server on a full disk answered 503, and the launch said only
    "too many 503 error responses": why (`database or disk is full`) was in its log."""
    from hpsearch.tracking.server import START_MARKER, last_server_error, store_paths

    log = store_paths(tmp_path)[2]
    assert last_server_error(tmp_path) is None  # no log yet
    log.parent.mkdir(parents=True)
    log.write_text(
        f"{START_MARKER} 1\nsqlite3.OperationalError: unable to open database file\n"
        f"{START_MARKER} 2\nINFO serving\nTraceback (most recent call last):\n"
        '  File "x.py", line 1\nsqlite3.OperationalError: database or disk is full\n'
        "[SQL: INSERT INTO runs]\nINFO 127.0.0.1 POST 503\n"
    )
    assert last_server_error(tmp_path) == "sqlite3.OperationalError: database or disk is full"
    log.write_text(f"{log.read_text()}{START_MARKER} 3\nINFO serving\n")
    assert last_server_error(tmp_path) is None  # an earlier start's
