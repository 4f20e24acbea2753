"""The local MLflow tracking server: one ``mlflow server`` subprocess per workdir.

Only this server process writes the SQLite file ``<workdir>/mlflow/mlflow.db``; every worker
logs over HTTP, so there are no "database is locked" errors. Artifacts are proxied by the same
server (``--serve-artifacts``) into ``<workdir>/mlflow/artifacts``. Starting it again on the same
workdir reuses the same store.

The server runs in its own process group (MLflow spawns uvicorn/worker children); ``stop()``
signals the whole group, SIGTERM first, then SIGKILL, and waits until the group is empty.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from hpsearch.errors import TrackingError

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
# Set by a launch for its workers when their URI is its work folder's embedded server.
EMBEDDED_TRACKING_ENV = "HPSEARCH_EMBEDDED_MLFLOW"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
DEFAULT_UI_PORT = 5000
DEFAULT_START_TIMEOUT_S = 180.0  # a cold start on 2 busy cores took ~25 s; leave headroom

# Extras of `mlflow server` that hpsearch does not use and that slow start-up a lot (MLflow 3
# starts a huey job runner with several consumer processes) or phone home.
SERVER_ENV: Mapping[str, str] = {
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "PYTHONWARNINGS": "ignore::DeprecationWarning",
}

# `mlflow server` options a user's environment may set for their own server (MLflow 3):
# inherited, MLFLOW_STATIC_PREFIX moved /health (the start waited out its time-out),
# MLFLOW_DEFAULT_ARTIFACT_ROOT took artifacts out of the work folder, and so on. The
# embedded server is configured by its command line alone.
SERVER_OPTION_ENV = (
    "MLFLOW_ARTIFACTS_DESTINATION",
    "MLFLOW_ARTIFACTS_ONLY",
    "MLFLOW_BACKEND_STORE_URI",
    "MLFLOW_DEFAULT_ARTIFACT_ROOT",
    "MLFLOW_EXPOSE_PROMETHEUS",
    "MLFLOW_GUNICORN_OPTS",
    "MLFLOW_HOST",
    "MLFLOW_PORT",
    "MLFLOW_READ_REPLICA_BACKEND_STORE_URI",
    "MLFLOW_REGISTRY_STORE_URI",
    "MLFLOW_SERVER_ALLOWED_HOSTS",
    "MLFLOW_SERVER_CORS_ALLOWED_ORIGINS",
    "MLFLOW_SERVER_DISABLE_SECURITY_MIDDLEWARE",
    "MLFLOW_SERVER_X_FRAME_OPTIONS",
    "MLFLOW_SERVE_ARTIFACTS",
    "MLFLOW_STATIC_PREFIX",
    "MLFLOW_TRACE_ARCHIVAL_CONFIG",
    "MLFLOW_UVICORN_OPTS",
    "MLFLOW_WORKERS",
    "MLFLOW_WORKSPACE_STORE_URI",
)


def server_env(base: Mapping[str, str]) -> dict[str, str]:
    """The embedded server's environment: `base` without the tracking URI (the server is
    the store's, not a client of another) and without `mlflow server` options meant for
    the user's own servers, plus SERVER_ENV."""
    dropped = {TRACKING_URI_ENV, *SERVER_OPTION_ENV}
    return {**{k: v for k, v in base.items() if k not in dropped}, **SERVER_ENV}


_SECRET_QUERY_KEYS = frozenset(
    {"password", "passwd", "pwd", "pass", "secret", "token", "access_token", "api_key", "apikey"}
)


# --------------------------------------------------------------------------- pure helpers


def resolve_tracking_uri(cli_value: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """Precedence: ``--tracking-uri`` value, then ``$MLFLOW_TRACKING_URI``, then None (meaning
    "start the embedded local server"). Empty strings count as unset. Raises TrackingError
    for ``HOST:PORT`` with no scheme (MLflow would take it for a folder)."""
    if cli_value is not None and cli_value.strip():
        value, origin = cli_value.strip(), "--tracking-uri"
    else:
        environ = os.environ if env is None else env
        value, origin = environ.get(TRACKING_URI_ENV, "").strip(), TRACKING_URI_ENV
    if value and re.fullmatch(r"[\w.-]+:\d+(/.*)?", value):  # HOST:PORT
        shown = redact_uri(value)  # its path may hold a token
        raise TrackingError(f"{origin} {shown!r}: no scheme; give http://{shown}")
    return value or None


def told_embedded(env: Mapping[str, str], cli_tracking_uri: str | None) -> bool:
    """Whether a worker's launch told it (`launcher.worker_env`) that its tracking URI is
    the work folder's embedded server; a URI on the worker's own command line is its user's."""
    return not cli_tracking_uri and env.get(EMBEDDED_TRACKING_ENV) == "1"


def redact_uri(uri: str) -> str:
    """``scheme://user:secret@host/db?password=x`` -> ``scheme://user:***@host/db?password=***``.

    Works for any URL (postgresql, mysql, http basic auth ...). Strings that are not URLs are
    returned unchanged unless they contain a ``://user:secret@`` pattern."""
    try:
        parts = urlsplit(uri)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            if ":" in userinfo:
                user = userinfo.split(":", 1)[0]
                netloc = f"{user}:***@{hostport}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
                query = urlencode(
                    [(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs],
                    safe="*",
                )
        if netloc == parts.netloc and query == parts.query:
            return uri
        return urlunsplit(SplitResult(parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        # Not parseable (e.g. a bad port): still never leak a password.
        return re.sub(r"(://[^:/@\s]*):[^@\s]*@", r"\1:***@", uri)


# In free text: a URL's `user:password@` (the password ends at the last "@" before the
# host: it may hold a raw "@", never "/", "?", "#" or white space), and a secret query value.
_USERINFO_IN_TEXT = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@]*):[^\s/?#]*@")
_SECRET_QUERY_IN_TEXT = re.compile(
    r"([?&](?:" + "|".join(sorted(_SECRET_QUERY_KEYS)) + r")=)[^&#\s'\"]*", re.IGNORECASE
)


def scrub(text: str) -> str:
    """``text`` with the credentials of every URL in it masked, wherever the URL sits:
    ``... request to http://bob:S3CRET@host/api failed`` -> ``... http://bob:***@host/api
    failed`` (MLflow's error messages hold the tracking URI, password included), and
    ``?password=x`` -> ``?password=***``."""
    text = _USERINFO_IN_TEXT.sub(r"\1:***@", text)
    return _SECRET_QUERY_IN_TEXT.sub(r"\1***", text)


class ScrubFilter(logging.Filter):
    """Masks URL credentials in a log record's message and traceback (`scrub`): the safety
    net under the callers that scrub what they log."""

    def filter(self, record: logging.LogRecord) -> bool:
        # A logger's filter runs outside its handlers' error handling: a record this cannot
        # format (a bad format string) goes on as it is rather than raise into the caller.
        try:
            message = record.getMessage()
            clean = scrub(message)
            if clean != message:
                record.msg, record.args = clean, None
            # A traceback is formatted here only when it holds a password: the handler's own
            # formatter formats the others.
            text = record.exc_text
            if record.exc_info and not text:
                text = logging.Formatter().formatException(record.exc_info)
            if text and scrub(text) != text:
                record.exc_text = scrub(text)
        except Exception:  # best effort, like any logging
            pass
        return True


# A logger's filter sees only the records made on that very logger, not its children's:
# each logger that may carry an MLflow error (hpsearch.tracking: search.runs, search.worker
# and this package) gets one.
SCRUBBED_LOGGERS = ("hpsearch", "hpsearch.tracking")


def install_log_scrubber() -> None:
    """Add a `ScrubFilter` to the `SCRUBBED_LOGGERS` (once each)."""
    for name in SCRUBBED_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, ScrubFilter) for f in target.filters):
            target.addFilter(ScrubFilter())


install_log_scrubber()


def store_paths(workdir: Path) -> tuple[Path, Path, Path]:
    """(SQLite file, artifacts folder, server log) of the local store under ``workdir``."""
    root = Path(workdir).resolve() / "mlflow"
    return root / "mlflow.db", root / "artifacts", root / "server.log"


def state_path(workdir: Path) -> Path:
    """``<workdir>/mlflow/server.json``: url and pid of the server running on that store."""
    return Path(workdir).resolve() / "mlflow" / "server.json"


def running_server_url(workdir: Path) -> str | None:
    """URL of a live, healthy server already serving the store of ``workdir`` (started by
    another hpsearch process), else None. ``hpsearch ui`` and launchers use it instead of
    starting a second writer of the same SQLite file."""
    try:
        state = json.loads(state_path(workdir).read_text())
        url, pid = str(state["url"]), int(state["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by someone else
    return url if health_ok(url) else None


def allowed_hosts_for(host: str, port: int, names: tuple[str, ...] = ()) -> str | None:
    """The ``--allowed-hosts`` value for a bind address, or None to keep MLflow's default
    (localhost and private IPs), which is right for loopback binds. When binding elsewhere the
    machine's own names are added so that ``http://<hostname>:<port>`` is not rejected by
    MLflow's DNS-rebinding protection."""
    if host in LOOPBACK_HOSTS:
        return None
    pats = ["localhost", "localhost:*", "127.0.0.1", "127.0.0.1:*", "[::1]", "[[]::1]:*"]
    pats += ["10.*", "192.168.*", *[f"172.{i}.*" for i in range(16, 32)], "fc00:*", "fd00:*"]
    pats += ["[[]fc00:*", "[[]fd00:*"]  # as a Host header brackets them ("[[]": a "[")
    for name in (*names, host):
        if name and name not in ("0.0.0.0", "::"):
            pats += [name, f"{name}:{port}"]
            if ":" in name:  # IPv6: a Host header brackets it ([fd00::5]:5000, the URL's)
                bare = name.strip("[]")  # compared as is: MLflow globs only with a "*"
                pats += [f"[{bare}]", f"[{bare}]:{port}"]
    return ",".join(dict.fromkeys(pats))


def server_command(
    workdir: Path,
    host: str,
    port: int,
    *,
    workers: int = 1,
    allowed_hosts: str | None = None,
    cors_allowed_origins: str | None = None,
    access_log: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """argv of the ``mlflow server`` process for the store under ``workdir``. Uvicorn's access
    log (one line per request, i.e. per epoch per worker) is off unless ``access_log``."""
    db, artifacts, _ = store_paths(workdir)
    cmd = [
        python,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{db}",
        "--serve-artifacts",
        "--artifacts-destination",
        str(artifacts),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--uvicorn-opts",
        "--timeout-graceful-shutdown 5" + ("" if access_log else " --no-access-log"),
    ]
    if allowed_hosts:
        cmd += ["--allowed-hosts", allowed_hosts]
    if cors_allowed_origins:
        cmd += ["--cors-allowed-origins", cors_allowed_origins]
    return cmd


def ui_command(workdir: Path, host: str = "127.0.0.1", port: int = DEFAULT_UI_PORT) -> list[str]:
    """argv that ``hpsearch ui`` runs (same store as the search), for display or docs."""
    names = (socket.gethostname(), socket.getfqdn())
    return server_command(workdir, host, port, allowed_hosts=allowed_hosts_for(host, port, names))


def one_line(text: str, limit: int = 600) -> str:
    """Last ``limit`` characters of ``text`` on one line (`` | `` between lines)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    flat = " | ".join(lines)
    return flat if len(flat) <= limit else "..." + flat[-limit:]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_hint(host: str) -> str:
    """`` (--port N is free)`` for a command whose port was taken; '' where ``host`` itself
    is the problem (not this machine's, or no such name)."""
    try:
        return f" (--port {free_port(host)} is free)"
    except OSError:
        return ""


def listen_problem(host: str, port: int) -> str | None:
    """Why this process could not listen on ``host:port`` (a listener holds it, no such
    address here, a name that does not resolve), or None when it could. TIME_WAIT leftovers
    of a stopped server do not count: SO_REUSEADDR, as uvicorn binds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:  # gaierror included
            return exc.strerror or str(exc)
    return None


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def health_ok(url: str, timeout_s: float = 2.0, *, any_status: bool = False) -> bool:
    """True when ``<url>/health`` answers 200; with ``any_status``, when a server answers
    there at all (a hosted MLflow may have no ``/health``)."""
    try:
        with urllib.request.urlopen(_request(url), timeout=timeout_s) as resp:
            return any_status or int(resp.status) == 200
    except urllib.error.HTTPError:  # an answer, not a 2xx one
        return any_status
    except (urllib.error.URLError, OSError, ValueError):
        return False


def server_answers(url: str, timeout_s: float = 1.0) -> bool:
    """Whether a server answers at ``url`` now: any reply to ``/health`` but a 5xx (a
    proxy's 502/503/504 while MLflow behind it is down). A hosted MLflow may have no
    ``/health`` (a 404 is an answer); where the client signs its calls in a way this
    request cannot (SigV4, client certificates, a plugin), any reply at all."""
    try:
        with urllib.request.urlopen(_request(url), timeout=timeout_s):
            return True
    except urllib.error.HTTPError as exc:
        return exc.code < 500 or any(os.environ.get(name) for name in OTHER_AUTH_ENV)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _request(url: str, path: str = "/health") -> urllib.request.Request:
    """GET ``<url><path>``; a login in the URL (``http://user:password@host``, which MLflow's
    client sends as basic auth) goes in an Authorization header: urllib cannot open such a
    URL itself. Else the credentials MLflow's client takes from the environment
    (MLFLOW_TRACKING_USERNAME / _PASSWORD, or MLFLOW_TRACKING_TOKEN)."""
    parts = urlsplit(url.rstrip("/"))
    headers: dict[str, str] = {}
    user, password = (
        os.environ.get("MLFLOW_TRACKING_USERNAME"),
        os.environ.get("MLFLOW_TRACKING_PASSWORD"),
    )
    if "@" in parts.netloc:
        login, _, hostport = parts.netloc.rpartition("@")
        name, _, secret = login.partition(":")
        user, password = unquote(name), unquote(secret)
        parts = parts._replace(netloc=hostport)
    if user is not None and password is not None:
        pair = f"{user}:{password}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(pair).decode("ascii")
    elif token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {token}"
    return urllib.request.Request(f"{urlunsplit(parts)}{path}", headers=headers)


# MLflow client settings for authentication other than a login or a token (MLflow 3).
OTHER_AUTH_ENV = (
    "MLFLOW_TRACKING_AUTH",
    "MLFLOW_TRACKING_AWS_SIGV4",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
)


# The schemes MLflow keeps runs under (a database's with its driver: postgresql+psycopg2).
TRACKING_SCHEMES = frozenset(
    {"http", "https", "databricks", "sqlite", "postgresql", "mysql", "mssql", "file"}
)


def _plugin_schemes() -> set[str]:
    """Schemes that installed MLflow plugins keep runs under (their tracking stores)."""
    from importlib.metadata import entry_points

    return {ep.name.lower() for ep in entry_points(group="mlflow.tracking_store")}


def check_tracking_uri(uri: str, timeout_s: float = 5.0, *, answer: bool = True) -> None:
    """Refuse, in one line, a tracking URI no run could be logged to, before anything is
    made: a folder (MLflow 3 keeps no new runs in a file store unless
    MLFLOW_ALLOW_FILE_STORE is true), a scheme MLflow does not know (`htp://`), a server
    that does not answer (unless `answer` is False: a worker's runs wait in its spool
    folder for one that answers later) or whose API refuses this client. A worker given
    one trained its trials untracked and exited 0. Raises TrackingError."""
    scheme = urlsplit(uri).scheme.lower()
    if uri.strip() == "databricks":  # MLflow's own name for the workspace's default profile
        return
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true")
    if scheme in ("", "file") and not allowed:
        raise TrackingError(
            f"tracking URI {redact_uri(uri)!r}: a folder, which MLflow 3 keeps no new runs "
            "in; give a server's http://HOST:PORT"
        )
    if scheme and scheme.split("+")[0] not in TRACKING_SCHEMES | _plugin_schemes():
        raise TrackingError(
            f"tracking URI {redact_uri(uri)!r}: MLflow keeps no runs under {scheme}://; give "
            "a server's http://HOST:PORT"
        )
    if scheme in ("http", "https"):
        if answer and not health_ok(uri, timeout_s=timeout_s, any_status=True):
            raise TrackingError(f"MLflow: no server answers at {redact_uri(uri)}")
        if (refused := api_refusal(uri, timeout_s)) is not None:
            raise TrackingError(f"MLflow at {redact_uri(uri)}: {refused}")


def api_refusal(url: str, timeout_s: float = 5.0) -> str | None:
    """Why an MLflow server that answers refuses this client's API calls, or None. Its
    /health passes without the Host check and without a login (MLflow 3), so a server that
    answers 401 or 403 to every call looked ready; the workers then trained untracked.
    One cheap read (experiments/search, max 1) as the workers' client would make it; no
    verdict where the client authenticates in a way this read cannot (an auth plugin, AWS
    SigV4, client certificates)."""
    if any(os.environ.get(name) for name in OTHER_AUTH_ENV):
        return None
    request = _request(url, "/api/2.0/mlflow/experiments/search?max_results=1")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return None
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            return (
                "401 unauthorized: give the server's login (MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD, or user:password@ in the URI)"
            )
        if exc.code == 403:
            host = urlsplit(url).netloc.rpartition("@")[2]
            return (
                f"403 forbidden: the server refuses host {host!r} (its --allowed-hosts, "
                "MLFLOW_PUBLIC_HOSTS in hpsearch's compose stack, must list it) or this "
                "user's permission"
            )
        if exc.code == 404:  # the client calls exactly this path under the URI
            return "404 not found: no MLflow API under this URI (is its path right?)"
        return None  # another answer: the client will tell
    except (urllib.error.URLError, OSError, ValueError):
        return None  # not answering is health_ok's to say


def _read_tail(path: Path, max_bytes: int = 8192) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


_ERROR_LINE = re.compile(r"\b\w+(?:Error|Exception): \S")


def last_server_error(workdir: Path) -> str | None:
    """The last error line in the log of `workdir`'s MLflow server (what its store raised
    behind a 5xx answer: `sqlite3.OperationalError: database or disk is full`), or None."""
    text = _read_tail(store_paths(workdir)[2], 65536)
    text = text[text.rfind(START_MARKER) + 1 :] if START_MARKER in text else text  # this start's
    for line in reversed(text.splitlines()):
        if _ERROR_LINE.search(line):
            return one_line(line.strip(), 300)
    return None


# --------------------------------------------------------------------------- the server


_LIVE: weakref.WeakSet[LocalServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # pragma: no cover - interpreter shutdown
    # Leave, not stop: a process that exits without releasing its server (an error on the
    # way out) must not stop it under the other processes that use it.
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.release()


class LocalServer:
    """A running ``mlflow server`` subprocess. Use :func:`start_local_server`."""

    def __init__(
        self, proc: subprocess.Popen[bytes], url: str, workdir: Path, log_path: Path
    ) -> None:
        self.proc = proc
        self.url = url
        self.workdir = workdir
        self.log_path = log_path
        self.pgid = proc.pid  # start_new_session=True: the child leads its own group
        self.started_s: float = 0.0  # seconds from spawn to a healthy /health
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(urlsplit(self.url).port or 0)

    def group_alive(self) -> bool:
        """Whether any process of the server's process group is still there."""
        return _group_alive(self.pgid)

    def running(self) -> bool:
        return self.proc.poll() is None

    def is_running(self) -> bool:
        """Whether the ``mlflow server`` process is still alive (alias of :meth:`running`)."""
        return self.running()

    def wait(self) -> int:
        """Block until the server exits (``hpsearch ui`` in the foreground); its return code."""
        return self.proc.wait()

    def log_tail(self, limit: int = 600) -> str:
        return one_line(_read_tail(self.log_path), limit)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``; returns when
        no process of the group remains (no orphans). Idempotent."""
        _LIVE.discard(self)
        _remove_state(self.workdir, self.pid)
        _stop_group(self.pgid, timeout_s, self.proc.poll)  # poll: reap our direct child
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1.0)

    def release(self, timeout_s: float = 10.0) -> Leave:
        """Leave the server as one of its users (see :func:`join_server`): it stops only
        when no other live process uses it; else it runs on, and the last to leave stops
        it."""
        _LIVE.discard(self)  # exiting must not stop a server that others still use
        # poll: reap our own child, else its zombie keeps the group "alive" until SIGKILL
        left = leave_server(self.workdir, self.pid, self.pgid, timeout_s, self.proc.poll)
        with contextlib.suppress(subprocess.TimeoutExpired):
            if left != "in use":
                self.proc.wait(timeout=1.0)
        return left

    def shared(self) -> bool:
        """Whether another live process uses the server too."""
        return _shared(self.workdir)

    def write_state(self) -> None:
        _write_state(self.workdir, {"url": self.url, "pid": self.pid, "pgid": self.pgid})

    def remove_state(self) -> None:
        """Remove ``server.json`` if it still describes this server."""
        _remove_state(self.workdir, self.pid)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalServer(url={self.url!r}, pid={self.pid}, workdir={str(self.workdir)!r})"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's group reused the id
        return False
    return True


def _stop_group(pgid: int, timeout_s: float, reap: Callable[[], object] = lambda: None) -> None:
    """SIGTERM a server's process group, SIGKILL what is left after ``timeout_s``; returns
    once no process of it remains."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            reap()
            if not _group_alive(pgid):
                return
            time.sleep(0.05)


def _write_state(workdir: Path, state: dict[str, Any]) -> None:
    """``server.json`` of a server this process started: it is the server's first user."""
    from hpsearch.packing import process_start

    start = process_start(int(state["pid"]))  # with the pid, names the server's process
    _save_state(workdir, {**state, "start": start, "users": [_me()]})


# What leaving a server did: stopped it (the last user), left it to other users, or found
# it gone already (or replaced by another server, whose users this process does not know).
Leave = Literal["stopped", "in use", "gone"]


def _me() -> list[int | None]:
    from hpsearch.packing import process_start

    return [os.getpid(), process_start(os.getpid())]


def _save_state(workdir: Path, state: dict[str, Any]) -> None:
    """Write ``server.json`` whole (rename into place: a reader never sees half of it)."""
    path = state_path(workdir)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)
    except OSError:  # a full disk: no half file is left behind (QA: an empty one was)
        with contextlib.suppress(OSError):
            tmp.unlink()


def _remove_state(workdir: Path, pid: int) -> None:
    path = state_path(workdir)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if int(json.loads(path.read_text())["pid"]) == pid:
            path.unlink()


def _live_users(state: Mapping[str, Any]) -> list[list[int | None]]:
    """The processes that use a server (launches, ``hpsearch ui``, standalone workers) and
    still run. A file of the version before names only the process that started it; one of
    the version before that names none: the server's parent is (unless it is gone, and the
    server was handed to init)."""
    from hpsearch.packing import holder_alive

    users = state.get("users")
    if users is None:
        owner = state.get("owner")
        if owner is None:  # two versions before: the process that started it is its parent
            owner = _parent(int(state.get("pid", 0)))
        users = [[owner, state.get("owner_start")]] if owner is not None else []
    live: list[list[int | None]] = []
    for user in users if isinstance(users, list) else []:
        with contextlib.suppress(ValueError, TypeError, IndexError):
            pid, start = int(user[0]), user[1]
            if holder_alive(pid, start if isinstance(start, int) else None):
                live.append([pid, start if isinstance(start, int) else None])
    return live


def _parent(pid: int) -> int | None:
    """The parent of a process of this machine (`/proc/<pid>/stat` field 4); None when it
    is gone, or init (1) or no one (0) adopted it."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
        parent = int(raw[raw.rfind(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return parent if parent > 1 else None


class StoreLock:
    """``<workdir>/mlflow/server.lock``, held while a process starts, joins or leaves the
    store's server: two launches starting at once would otherwise start two writers of one
    SQLite file, and two leaving at once could each think the other still uses it. A
    context manager; ``acquire`` and ``release`` let another thread release it."""

    def __init__(self, workdir: Path) -> None:
        self.path = state_path(workdir).with_suffix(".lock")
        self._fh: IO[str] | None = None

    def acquire(self) -> StoreLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(self.path, "a")  # noqa: SIM115 - closed by release()
        except OSError as exc:
            raise TrackingError(
                f"cannot create the MLflow store under {self.path.parent}: {exc}"
            ) from exc
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # blocks while another start runs
        except BaseException:
            fh.close()
            raise
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # closing drops the flock
            self._fh = None

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def store_lock(workdir: Path) -> StoreLock:
    """The store's :class:`StoreLock` (not yet taken)."""
    return StoreLock(workdir)


def leave_server(
    workdir: Path,
    pid: int,
    pgid: int,
    timeout_s: float = 10.0,
    reap: Callable[[], object] = lambda: None,
) -> Leave:
    """This process stops using the store's server (``pid``, process group ``pgid``); the
    last of its users to leave stops it. Users that are gone (killed with SIGKILL) do not
    count, so a server they left running stops with the next one to use it. ``reap``: the
    starter's ``Popen.poll``, which reaps the server's leader as it exits."""
    with store_lock(workdir):
        try:
            state = json.loads(state_path(workdir).read_text())
            current = int(state["pid"]) == pid
        except (OSError, ValueError, KeyError, TypeError):
            state, current = {}, False
        if current:
            users = _live_users(state)
            mine = next((u for u in users if u[0] == os.getpid()), None)
            if mine is not None:
                users.remove(mine)  # one entry: a process that joined twice leaves twice
            if users:
                _save_state(workdir, {**state, "users": users})
                return "in use"
            _remove_state(workdir, pid)
        # Only while server.json still names it, or names none (a server it no longer names
        # was replaced by another one, whose users this process does not know).
        if not _group_alive(pgid) or (not current and state) or _leader_replaced(state, pid):
            return "gone"
        _stop_group(pgid, timeout_s, reap)
        return "stopped"


def _leader_replaced(state: Mapping[str, Any], pid: int) -> bool:
    """Whether the process now under the server leader's PID started at another time than
    the one server.json recorded: the server is gone and its PID (and so the group id) was
    reused, by a worker started in a session of its own, say, which must not be killed."""
    from hpsearch.packing import process_start

    start = state.get("start")
    now = process_start(pid)
    return isinstance(start, int) and now is not None and now != start


@dataclass
class SharedServer:
    """The running server of the work folder's store that this process joined (see
    :func:`join_server`): another launch's, ``hpsearch ui``'s, or one a killed launch left
    running. :meth:`release` leaves it; the last user to leave stops it."""

    url: str
    pid: int
    pgid: int
    workdir: Path

    def is_running(self) -> bool:
        return _group_alive(self.pgid)

    @property
    def port(self) -> int:
        return int(urlsplit(self.url).port or 0)

    def release(self, timeout_s: float = 10.0) -> Leave:
        """Leave the server; the last user to leave stops it."""
        return leave_server(self.workdir, self.pid, self.pgid, timeout_s)

    def shared(self) -> bool:
        """Whether another live process uses the server too."""
        return _shared(self.workdir)


def _shared(workdir: Path) -> bool:
    try:
        state = json.loads(state_path(workdir).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and any(u[0] != os.getpid() for u in _live_users(state))


JOIN_HEALTH_S = 30.0  # s a live server that does not answer /health is waited for


def _server_alive(state: Mapping[str, Any], pgid: int) -> bool:
    """Whether the server ``server.json`` names still runs: its process group, and its
    leader the same process (a file of the version before has no start time)."""
    from hpsearch.packing import holder_alive

    start = state.get("start")
    if not _group_alive(pgid):
        return False
    # A zombie leader (its starter has not reaped it) while its group still serves: running
    # (treated as gone, a second server was started on the same store).
    return holder_alive(
        int(state["pid"]), start if isinstance(start, int) else None, zombie_alive=True
    )


def _age_s(start_ticks: object) -> float | None:
    """Seconds since a process started, from its start in clock ticks since boot
    (`packing.process_start`); None where that is unknown."""
    if not isinstance(start_ticks, int):
        return None
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def join_server(workdir: Path, *, as_user: bool = True) -> SharedServer | None:
    """Join the live, healthy server of ``workdir``'s store as one of its users (recorded
    in ``server.json``, so that whichever user leaves last stops it), or None when there is
    none. Call it under :func:`store_lock`, which :func:`start_local_server` needs too, so
    that a server starting meanwhile is joined rather than started twice. ``as_user``
    False: this process is named a user already (`restart_server`'s)."""
    try:
        state = json.loads(state_path(workdir).read_text())
        url, pid, pgid = str(state["url"]), int(state["pid"]), int(state["pgid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not _server_alive(state, pgid):
        return None
    # A server still in its start (named as it was spawned, its starter gone since) gets
    # what is left of the start's time limit; a running one that stopped answering, 30 s.
    age = _age_s(state.get("start"))
    left = DEFAULT_START_TIMEOUT_S - age if age is not None else 0.0
    deadline = time.monotonic() + max(JOIN_HEALTH_S, left)
    while not health_ok(url):
        # Alive but not answering (busy, or still starting): a second server would be a
        # second writer of the same SQLite file, and would leave this one running for good.
        if not _server_alive(state, pgid):
            return None
        if time.monotonic() >= deadline:
            raise TrackingError(
                f"the MLflow server of {Path(workdir).resolve()} (pid {pid}) runs but does "
                f"not answer at {url} after {max(JOIN_HEALTH_S, left):.0f} s; stop it "
                f"(kill -- -{pgid}) or try again"
            )
        time.sleep(1.0)
    users = [*_live_users(state), *([_me()] if as_user else [])]
    state.pop("owner", None)  # the version before named only the process that started it
    state.pop("owner_start", None)
    _save_state(workdir, {**state, "users": users})
    return SharedServer(url, pid, pgid, Path(workdir))


def restart_server(
    dead: LocalServer | SharedServer, give_up: Callable[[], bool] = lambda: False
) -> LocalServer | SharedServer | None:
    """Start a server of this process's that died again, on its port (the URI its users
    were given), under the store's lock; or one it joined (a killed launch's, whose
    starter is gone), once its whole process group is gone. Another user may have started
    one first: it is joined. The dead one's other live users (another launch, `hpsearch
    ui`, a standalone worker) stay users of the new one, so that whoever leaves last stops
    it. None when `give_up()` says so once the lock is held (the launch is stopping)."""
    workdir = dead.workdir
    with store_lock(workdir):
        if give_up():
            return None
        try:
            old = json.loads(state_path(workdir).read_text())
        except (OSError, ValueError):
            old = {}
        if isinstance(old, dict) and old.get("pid") != dead.pid:
            # Started again by another of its users, which kept this process a user of the
            # new one: joined once more, it counted twice and left it running for good (QA).
            carried = any(u[0] == os.getpid() for u in _live_users(old))
            joined = join_server(workdir, as_user=not carried)
            if joined is not None:
                if joined.url != dead.url:  # another start, elsewhere: not the URI given out
                    joined.release()
                    raise TrackingError(
                        f"another MLflow server of {workdir} started at {joined.url} while "
                        f"{dead.url}, which this launch's workers log to, was down"
                    )
                if isinstance(dead, LocalServer):
                    _LIVE.discard(dead)
                return joined
        others = (
            [u for u in _live_users(old) if u[0] != os.getpid()]
            if isinstance(old, dict) and old.get("pid") == dead.pid
            else []
        )
        if isinstance(dead, LocalServer) and dead.group_alive():  # a child may hold the port
            dead.stop()
        elif isinstance(dead, SharedServer) and dead.is_running():
            raise TrackingError(f"the MLflow server of {workdir} at {dead.url} still runs")
        else:  # nothing to signal: its group id may be another process's by now
            if isinstance(dead, LocalServer):
                _LIVE.discard(dead)
            _remove_state(workdir, dead.pid)
        server = start_local_server(workdir, port=dead.port)
        if others:  # best effort: the server runs either way, and is this process's to stop
            with contextlib.suppress(OSError, ValueError, TypeError):
                state = json.loads(state_path(workdir).read_text())
                _save_state(workdir, {**state, "users": [*state.get("users", []), *others]})
        return server


def start_local_server(
    workdir: Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    workers: int = 1,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    allowed_hosts: str | None = None,
    cors_allowed_origins: str | None = None,
) -> LocalServer:
    """Start ``mlflow server`` on the SQLite store under ``workdir`` and wait for ``/health``.

    ``port=None`` picks a free port. Raises :class:`TrackingError` (one line, with the tail of
    the server's log) when another server already serves this store (see
    :func:`running_server_url`; one writer per SQLite file), the port is taken, the server
    exits, or it is not healthy within ``timeout_s``."""
    workdir = Path(workdir).resolve()
    if (other := running_server_url(workdir)) is not None:
        raise TrackingError(
            f"an MLflow server for {workdir} is already running at {other}; use it "
            f"(--tracking-uri {other}) instead of starting a second writer of the same store"
        )
    db, artifacts, _ = store_paths(workdir)
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        artifacts.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrackingError(f"cannot create the MLflow store under {db.parent}: {exc}") from exc
    picked = port is None
    if port is None:
        port = free_port(host if host not in ("0.0.0.0", "::") else "127.0.0.1")
    elif (problem := listen_problem(host, port)) is not None:
        raise TrackingError(f"cannot start the MLflow server on {host}:{port}: {problem}")
    attempt = 1
    while True:
        try:
            return _spawn_and_wait(
                workdir, host, port, workers, timeout_s, allowed_hosts, cors_allowed_origins
            )
        except _PortTaken as exc:
            # A port picked free can be taken before the server binds it (another server,
            # or an outgoing connection given it as its local port): pick another.
            if not picked or attempt == PICKED_PORT_ATTEMPTS:
                raise TrackingError(str(exc)) from None
            port = free_port(host if host not in ("0.0.0.0", "::") else "127.0.0.1")
            attempt += 1


PICKED_PORT_ATTEMPTS = 3
START_MARKER = "==== hpsearch: starting"  # begins each start's part of the server log


class _PortTaken(Exception):
    """The server exited because its port was taken; the message is the one-line error."""


def _spawn_and_wait(
    workdir: Path,
    host: str,
    port: int,
    workers: int,
    timeout_s: float,
    allowed_hosts: str | None,
    cors_allowed_origins: str | None,
) -> LocalServer:
    db, _, log_path = store_paths(workdir)
    if allowed_hosts is None:
        allowed_hosts = allowed_hosts_for(host, port, (socket.gethostname(), socket.getfqdn()))
    cmd = server_command(
        workdir,
        host,
        port,
        workers=workers,
        allowed_hosts=allowed_hosts,
        cors_allowed_origins=cors_allowed_origins,
    )
    env = server_env(os.environ)
    url = f"http://{_url_host(host)}:{port}"
    t0 = time.monotonic()
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        log.write(f"\n{START_MARKER} {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(db.parent),
            start_new_session=True,
        )
    except OSError as exc:
        raise TrackingError(f"cannot start the MLflow server ({cmd[0]}): {exc}") from exc
    finally:
        log.close()
    server = LocalServer(proc, url, workdir, log_path)
    # Named at once, not once healthy: a starter killed during the start (tens of seconds
    # cold) would leave a server no one can find, and the next launch would start a second
    # writer of the store. A joiner waits for a named server that does not answer yet.
    server.write_state()
    try:
        deadline = t0 + timeout_s
        delay = 0.1
        while True:
            if proc.poll() is not None:
                server.stop()
                message = (
                    f"the MLflow server exited with code {proc.returncode} before it was ready: "
                    f"{server.log_tail()}"
                )
                this_start = _read_tail(log_path).rsplit(START_MARKER, 1)[-1]
                if "address already in use" in this_start.lower():
                    raise _PortTaken(message)
                raise TrackingError(message)
            if health_ok(url, timeout_s=2.0):
                server.started_s = time.monotonic() - t0
                return server
            if time.monotonic() >= deadline:
                server.stop()
                raise TrackingError(
                    f"the MLflow server at {url} was not healthy after {timeout_s:.0f} s: "
                    f"{server.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C while it starts: no server left behind
        server.stop()
        raise


def attach_or_start(
    workdir: Path, host: str = "127.0.0.1", port: int | None = None
) -> LocalServer | SharedServer:
    """The server of ``workdir``'s store: the running one, joined, else one started here.
    Either way this process is one of its users: ``release()`` it when done, and the last
    user to leave stops it."""
    with store_lock(workdir):
        return join_server(workdir) or start_local_server(workdir, host=host, port=port)


def serve_ui(
    workdir: Path, host: str = "127.0.0.1", port: int | None = DEFAULT_UI_PORT
) -> LocalServer:
    """``hpsearch ui``: start the server on the store of ``workdir`` and return it, this
    process its first user; the CLI prints ``server.url`` and calls ``server.release()`` on
    Ctrl-C. ``port=None`` picks a free port. Call it under :func:`store_lock`, after
    :func:`join_server` found no server (one writer per SQLite file). A port another
    program holds is refused with a free one to use instead."""
    if port is not None and (problem := listen_problem(host, port)) is not None:
        raise TrackingError(
            f"cannot serve the MLflow UI on {host}:{port}: {problem}{free_port_hint(host)}"
        )
    return start_local_server(workdir, host=host, port=port)


__all__ = [
    "DEFAULT_UI_PORT",
    "SERVER_ENV",
    "TRACKING_SCHEMES",
    "Leave",
    "LocalServer",
    "SharedServer",
    "allowed_hosts_for",
    "attach_or_start",
    "check_tracking_uri",
    "free_port",
    "free_port_hint",
    "health_ok",
    "join_server",
    "leave_server",
    "one_line",
    "redact_uri",
    "resolve_tracking_uri",
    "running_server_url",
    "scrub",
    "serve_ui",
    "server_command",
    "start_local_server",
    "state_path",
    "store_lock",
    "store_paths",
    "ui_command",
]
