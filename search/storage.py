"""Where studies live: an Optuna journal file by default, PostgreSQL for teams.

Precedence: `--storage`, then `HPSEARCH_STORAGE`, then `<workdir>/optuna.journal`.
Optuna owns its schema; we only build the storage object and a lock around `ask`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import optuna
import sqlalchemy as sa
from hpsearch.errors import HpsearchWarning, StorageError
from hpsearch.rdb import FastRDBStorage, budget_lock_held
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from optuna.storages.journal._file import get_lock_file
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError

JOURNAL_NAME = "optuna.journal"
SUPPORTED = (
    "postgresql://, postgresql+psycopg2://, postgresql+psycopg://, sqlite:/// or a journal "
    "file path (or journal:PATH)"
)

T = TypeVar("T")


@dataclass(frozen=True)
class StorageSpec:
    """A resolved storage location. `url` may hold a password: print `display` instead."""

    kind: str  # "journal" | "rdb"
    url: str  # journal: absolute file path; rdb: SQLAlchemy URL with driver
    display: str  # password removed

    @property
    def is_postgres(self) -> bool:
        return self.kind == "rdb" and self.url.startswith("postgresql")


def redact(url: str) -> str:
    """The URL with its password replaced by ***, in the user info or the query string
    (libpq's `?password=`); a password holding a raw "@" ends at the host's last "@"."""
    from hpsearch.tracking.server import redact_uri

    if "://" not in url:
        return url
    # SQLAlchemy's parse takes a password holding "/", "?" or "#", which urlsplit cuts at.
    # ValueError: a port that is not a number.
    try:
        url = make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # unparsable: up to the last "@" is the password's
        url = re.sub(r"(://[^:/@\s]*):\S*@", r"\1:***@", url)
    return redact_uri(url)


def postgres_driver() -> str:
    """psycopg2 when installed, else psycopg 3. A plain postgresql:// URL means this driver.

    SQLAlchemy 2.1 maps a bare `postgresql://` to psycopg 3; with only psycopg2-binary
    installed Optuna would then fail with "Failed to import DB access module".
    """
    if importlib.util.find_spec("psycopg2") is not None:
        return "psycopg2"
    if importlib.util.find_spec("psycopg") is not None:
        return "psycopg"
    raise StorageError("PostgreSQL storage needs psycopg2-binary: pip install psycopg2-binary")


def normalize_url(url: str) -> str:
    """Give bare postgres URLs an installed driver; leave everything else as it is."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return f"postgresql+{postgres_driver()}://" + url[len(prefix) :]
    return url


# SQLAlchemy's URL pattern after "scheme://" (user, password to its first "@", host, port):
# the database part as written.
_RAW_DATABASE = re.compile(
    r"(?:[^:/]*(?::[^@]*)?@)?(?:\[[^/?]+\]|[^/:?]+)?(?::[^/?]*)?(?:/([^?]*))?"
)


PG_DRIVERS = ("", "psycopg2", "psycopg", "pg8000")  # SQLAlchemy's PostgreSQL dialects


def resolve_storage(
    cli_value: str | None, workdir: Path, *, given_as: str = "--storage"
) -> StorageSpec:
    """The storage `cli_value` names, else HPSEARCH_STORAGE, else the work folder's journal.
    `given_as`: how errors name the value (the Python API's `storage`)."""
    value = cli_value or os.environ.get("HPSEARCH_STORAGE") or ""
    origin = given_as if cli_value else "HPSEARCH_STORAGE"
    if not value:
        path = (workdir / JOURNAL_NAME).resolve()
        return StorageSpec("journal", str(path), f"journal:{path}")
    if "://" not in value:
        if value.startswith("journal:"):  # as every command prints a journal storage
            path = Path(value.removeprefix("journal:")).expanduser().resolve()  # no shell's ~
            return StorageSpec("journal", str(path), f"journal:{path}")
        if value.endswith((".journal", ".log")):
            path = Path(value).resolve()
            return StorageSpec("journal", str(path), f"journal:{path}")
        raise StorageError(
            f"{origin}: {value!r}: not a storage URL; use {SUPPORTED} (a journal file's name "
            "ends in .journal or .log)"
        )
    scheme, rest = value.split("://", 1)
    if scheme.startswith("journal"):
        path = Path(rest).resolve()
        return StorageSpec("journal", str(path), f"journal:{path}")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    raw_at = StorageError(  # not shown: its redaction would show the password's end as host
        f"{origin}: a {scheme} URL whose password holds a raw '@' (the host would be "
        "read from after the first one); write it as %40, e.g. postgresql://user:p%40ss@host/db"
    )
    if "@" in authority.rpartition("@")[0].partition(":")[2]:  # the password's part
        raise raw_at
    base, _, driver = scheme.lower().partition("+")
    # Exactly these: a prefix let `postgresq://` through to SQLAlchemy's "Can't load
    # plugin: sqlalchemy.dialects:postgresq" (QA).
    drivers = {"postgresql": PG_DRIVERS, "postgres": PG_DRIVERS, "sqlite": ("", "pysqlite")}
    if driver not in drivers.get(base, ()):
        raise StorageError(
            f"{origin}: {redact(value)!r}: unsupported scheme {scheme!r}; use {SUPPORTED}"
        )
    if base == "sqlite":
        db_path = rest[1:].split("?")[0]  # sqlite:///rel.db, sqlite:////abs.db
        if not db_path or db_path == ":memory:":
            raise StorageError(
                f"{origin}: {value!r}: an in-memory SQLite database is one process's, which "
                "workers cannot share; give a file: sqlite:///path/to/optuna.db"
            )
    url = normalize_url(value)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        raise StorageError(f"{origin}: {redact(value)!r}: malformed URL: {exc}") from exc
    # A password holding "/" before its raw "@" (u:s3/x@cret@h) splits the authority
    # early: the "@" shows in the host, or in the database name still encoded (read as
    # SQLAlchemy does; its `database` is decoded, and a name's %40 is fine).
    raw_db = _RAW_DATABASE.match(rest)
    if parsed.password is not None and (
        "@" in (parsed.host or "") or (raw_db is not None and "@" in (raw_db.group(1) or ""))
    ):
        raise raw_at
    return StorageSpec("rdb", url, redact(url))


def _cannot_connect(spec: StorageSpec, exc: BaseException) -> StorageError:
    """`storage S: cannot connect: ...`; for a SQLite file whose folder is not there, that
    (SQLite says "unable to open database file")."""
    if spec.url.startswith("sqlite") and (path := make_url(spec.url).database):
        folder = Path(path).expanduser().parent
        if not folder.is_dir():
            return StorageError(
                f"storage {spec.display}: cannot connect: folder {folder} does not exist"
            )
    return StorageError(f"storage {spec.display}: cannot connect: {_one_line(exc)}")


def _one_line(exc: BaseException) -> str:
    while getattr(exc, "orig", None) is None and exc.__cause__ is not None:
        exc = exc.__cause__
    orig = getattr(exc, "orig", None) or exc
    text = " ".join(str(orig).split())
    return text[:300]


class WholeLineJournal(JournalFileBackend):
    """Optuna's journal file, whose appends leave no part of a line: a write that fails (a
    full disk) is cut back to where the file ended, and a last line left without its
    newline (a process killed mid-write, an earlier version's failed write) is cut off
    before the next append. Optuna's append left the part written, and the next record was
    written onto it: one line that is not JSON, and every later read of the study failed."""

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
        with get_lock_file(self._lock):
            fd = os.open(self._file_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
            try:
                end = _whole_lines_end(fd)
                written = False
                try:
                    if end < os.fstat(fd).st_size:
                        os.ftruncate(fd, end)  # never read: Optuna skips an unterminated line
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    written = True
                    os.fsync(fd)
                except OSError as exc:
                    # Only a part-line is cut: whole lines (an fsync that failed after them,
                    # on NFS say) may have been read by other processes, whose offsets
                    # would then point into later records.
                    if not written:
                        with contextlib.suppress(OSError):
                            os.ftruncate(fd, end)
                    if exc.filename is None:  # os.write's: the commands name the file full
                        exc.filename = str(self._file_path)
                    raise
            finally:
                os.close(fd)


def _whole_lines_end(fd: int, chunk: int = 1 << 16) -> int:
    """The offset just past the file's last newline (0 when it has none)."""
    pos = os.fstat(fd).st_size
    if pos == 0 or os.pread(fd, 1, pos - 1) == b"\n":  # the rule: one byte read
        return pos
    while pos > 0:
        start = max(0, pos - chunk)
        block = os.pread(fd, pos - start, start)
        cut = block.rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        pos = start
    return 0


def open_storage(
    spec: StorageSpec,
    *,
    pool_size: int = 2,
    heartbeat_interval: float | None = None,
    grace_period: float | None = None,
    failed_trial_callback: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None = None,
    create: bool = True,
    pre_ping: bool = False,
) -> BaseStorage:
    """Open the storage, checking the connection so that a bad URL fails with one line.
    `create=False` (readers) leaves a database's missing Optuna tables uncreated;
    `pre_ping` tests each pooled connection before use (see below: for long-lived readers
    whose requests are few, such as the dashboard)."""
    if spec.kind == "journal":
        path = Path(spec.url)
        if path.is_dir():
            raise StorageError(f"storage {spec.display}: is a folder, not a journal file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"storage {spec.display}: cannot create folder: {exc.strerror}"
            ) from exc
        try:
            # Optuna skips a last line without its newline (one being written), so another
            # program's one-line file read as a journal of no studies, and its first
            # write was appended to that line. Every journal line is a JSON object.
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as fh:
                head = fh.read(64).lstrip()
                if head and not head.startswith(b"{"):
                    raise StorageError(
                        f"storage {spec.display}: not a readable Optuna journal: its first line is "
                        "not a JSON object"
                    )
            backend = WholeLineJournal(str(path), lock_obj=JournalFileOpenLock(str(path)))
            return JournalStorage(backend)  # reads the whole journal
        except OSError as exc:
            raise StorageError(f"storage {spec.display}: cannot read: {exc}") from exc
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            # A line that is not JSON (or not a JSON object), or an operation Optuna does
            # not know ("Should not reach."): a damaged file, or another program's.
            raise StorageError(
                f"storage {spec.display}: not a readable Optuna journal: "
                f"{type(exc).__name__}: {_one_line(exc)}"
            ) from exc
    # No pool_pre_ping: it adds a round trip to every session Optuna opens (about 16 per
    # trial). A connection a database restart broke fails its statement instead;
    # SQLAlchemy then discards the pool's connections and `with_db_retry` runs the
    # operation again on new ones. A reader that serves requests without that retry (the
    # dashboard) pings instead: its first page after a restart was an error.
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True} if pre_ping else {}
    if spec.is_postgres:
        # Each worker process keeps a small pool: 16 workers x (2 + 2) stay far below
        # PostgreSQL's default max_connections=100.
        engine_kwargs.update(
            pool_size=pool_size,
            max_overflow=2,
            pool_recycle=300,  # seconds
            connect_args=pg_connect_args(spec.url),
        )
    try:
        with _schema_lock(spec):
            if create:
                _create_schema(spec)
            with warnings.catch_warnings():
                # Optuna's "heartbeat_interval is experimental" notice, two lines in every
                # worker's log: hpsearch chose it (its heartbeats are how a dead worker's
                # trial is found), the user did not.
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return FastRDBStorage(
                    spec.url,
                    skip_table_creation=True,
                    engine_kwargs=engine_kwargs,
                    heartbeat_interval=heartbeat_interval,
                    grace_period=grace_period,
                    heartbeat_stale_trial_callback=failed_trial_callback,
                )
    except (SQLAlchemyError, NoSuchModuleError) as exc:
        raise _cannot_connect(spec, exc) from exc
    except ImportError as exc:
        raise StorageError(f"storage {spec.display}: driver missing: {exc}") from exc
    except RuntimeError as exc:  # Optuna: the tables' schema is another Optuna version's
        raise StorageError(f"storage {spec.display}: {_one_line(exc)}") from exc
    except optuna.exceptions.StorageInternalError as exc:  # Optuna's set-up read failed
        if _undefined_table(exc):  # its version table is missing
            raise StorageError(
                f"storage {spec.display}: not an Optuna database (a table named 'studies' "
                f"is there, Optuna's others are not): {_one_line(exc)}"
            ) from exc
        raise StorageError(
            f"storage {spec.display}: cannot read Optuna's tables: {_one_line(exc)}"
        ) from exc


def _undefined_table(exc: BaseException) -> bool:
    """Whether a database error, or one it was raised from, is PostgreSQL's
    undefined_table (SQLSTATE 42P01) or SQLite's "no such table"."""
    seen: BaseException | None = exc
    for _ in range(8):  # the chain: Optuna's error, SQLAlchemy's, the driver's
        if seen is None:
            return False
        orig = getattr(seen, "orig", None)
        code = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
        if code == "42P01" or "no such table" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _create_schema(spec: StorageSpec) -> None:
    """Optuna's tables where missing, made on connections that close when done (a failed
    attempt leaves none open in a pool).

    The schema lock orders hpsearch's processes only; another Optuna client on the same
    empty database (optuna-dashboard, a notebook) can create a table between Optuna's
    existence check and its CREATE. A second attempt finds it there."""
    if has_optuna_tables(spec):  # the usual case: one query, not Optuna's whole set-up
        return
    _refuse_foreign_schema(spec)
    attempt = 1
    while True:
        try:
            RDBStorage(spec.url, engine_kwargs=_one_shot_engine_kwargs(spec)).engine.dispose()
            return
        except SQLAlchemyError as exc:
            if not is_schema_race(exc) or attempt == SCHEMA_RACE_ATTEMPTS:
                raise
            time.sleep(0.2 * attempt)  # seconds
            attempt += 1


def _one_shot_engine_kwargs(spec: StorageSpec) -> dict[str, Any]:
    """An engine whose connections close when returned; on PostgreSQL one that gives up on
    a server that accepts the connection and never answers."""
    kwargs: dict[str, Any] = {"poolclass": sa.pool.NullPool}
    if spec.is_postgres:
        kwargs["connect_args"] = pg_connect_args(spec.url)
    return kwargs


# Every session in UTC: heartbeats are CURRENT_TIMESTAMP stored in a column without a time
# zone, which the session's zone converts, and a server whose zone changes for daylight
# saving made live trials look an hour stale (or dead ones fresh for an hour). Keepalives,
# both ways (s): a worker host that vanishes while it holds the study's advisory lock
# releases it in about a minute, not after the kernel's two hours, which stalled every asker.
PG_SESSION_OPTIONS = (
    "-c timezone=UTC -c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 "
    "-c tcp_keepalives_count=3"
)


# ms a request may stay unacknowledged before libpq drops the connection (libpq 12 and
# later): a database host that vanishes mid-request (power, a network cut) otherwise holds
# the worker in the kernel's retransmissions for about 15 minutes, where keepalives cover
# idle connections only. The dropped connection is then an outage like any other.
PG_TCP_USER_TIMEOUT_MS = 60_000


def _libpq_version(url: str) -> int | None:
    """The version of the libpq the URL's driver uses (120000 for 12.0); None when unknown."""
    try:
        if make_url(url).get_driver_name() == "psycopg":
            import psycopg

            return int(psycopg.pq.version())
        import psycopg2.extensions

        return int(psycopg2.extensions.libpq_version())
    except (ImportError, AttributeError, ValueError, ArgumentError, NoSuchModuleError):
        return None


def pg_connect_args(url: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """libpq connection parameters for hpsearch's PostgreSQL engines. Options the user gave
    (the URL's `options`, else PGOPTIONS, which libpq reads only when no `options` is
    given) come first, ours after them; a parameter the URL sets is left to it (SQLAlchemy's
    connect_args would override it)."""
    env = os.environ if environ is None else environ
    query = sa.engine.make_url(url).query
    given = query.get("options")
    given = " ".join(given) if isinstance(given, tuple) else given
    given = given or env.get("PGOPTIONS")
    ours: dict[str, Any] = {
        "connect_timeout": 10,  # seconds
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }
    if (_libpq_version(url) or 0) >= 120000:  # an older libpq refuses the parameter
        ours["tcp_user_timeout"] = PG_TCP_USER_TIMEOUT_MS
    args = {k: v for k, v in ours.items() if k not in query}
    args["options"] = f"{given} {PG_SESSION_OPTIONS}" if given else PG_SESSION_OPTIONS
    return args


def init_storage(storage: str | None, workdir: Path) -> StorageSpec:
    """Create Optuna's tables in the storage, under hpsearch's schema lock; nothing when they
    are there. For a team's database before many workers start at once: a plain Optuna
    client (the gRPC proxy, optuna-dashboard) does not take the lock and would race them."""
    spec = resolve_storage(storage, workdir)
    storage_ = open_storage(spec, pool_size=1)
    engine = getattr(storage_, "engine", None)
    if engine is not None:
        engine.dispose()  # its connections, now: the caller only wanted the tables
    return spec


def storage_file(spec: StorageSpec) -> Path | None:
    """The file a journal or SQLite storage keeps its studies in; None for a database
    server's, or SQLite in memory."""
    if spec.kind == "journal":
        return Path(spec.url)
    url = make_url(spec.url)
    db = url.database or ""
    return Path(db) if url.get_backend_name() == "sqlite" and db not in ("", ":memory:") else None


def has_optuna_tables(spec: StorageSpec) -> bool:
    """Whether the database holds Optuna's tables; reads only (a SQLite file that does not
    exist is not created). For readers, which must not create a schema in a database a
    URL names by mistake."""
    file = storage_file(spec)
    if spec.kind == "journal":
        return file is not None and file.exists()  # a folder there: open_storage says so
    if make_url(spec.url).get_backend_name() == "sqlite" and (file is None or not file.is_file()):
        return False
    try:
        engine = sa.create_engine(spec.url, **_one_shot_engine_kwargs(spec))
    except (SQLAlchemyError, NoSuchModuleError) as exc:
        raise _cannot_connect(spec, exc) from exc
    except ImportError as exc:
        raise StorageError(f"storage {spec.display}: driver missing: {exc}") from exc
    try:
        with engine.connect() as conn:
            return bool(sa.inspect(conn).has_table("studies"))
    except SQLAlchemyError as exc:
        raise _cannot_connect(spec, exc) from exc
    finally:
        engine.dispose()


def _refuse_foreign_schema(spec: StorageSpec) -> None:
    """Raise StorageError for a database another migrated application owns (its
    `alembic_version` table without Optuna's `studies`: MLflow's backend store named by
    mistake, say), where Optuna would add its tables beside that application's."""
    if spec.kind != "rdb":
        return
    engine = sa.create_engine(spec.url, **_one_shot_engine_kwargs(spec))
    try:
        with engine.connect() as conn:
            names = sorted(sa.inspect(conn).get_table_names())
    except SQLAlchemyError as exc:
        raise _cannot_connect(spec, exc) from exc
    finally:
        engine.dispose()
    if "alembic_version" in names:
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise StorageError(
            f"storage {spec.display}: not an Optuna database: it holds another "
            f"application's tables ({shown}) and no Optuna study table; name an empty "
            "database or one of Optuna's"
        )


# SQLSTATEs of a schema object that appeared between a check and a CREATE: unique_violation
# (pg_type's name index, Optuna's one version_info row), duplicate_table, duplicate_object.
_SCHEMA_RACE_CODES = frozenset({"23505", "42P07", "42710"})
SCHEMA_RACE_ATTEMPTS = 4


def is_schema_race(exc: BaseException) -> bool:
    """True for the error of creating a schema object that another process created first."""
    orig = getattr(exc, "orig", None)
    code = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)  # psycopg2, 3
    return code in _SCHEMA_RACE_CODES


class HeartbeatStorage(Protocol):
    """What a storage that records trial heartbeats offers (Optuna's `BaseHeartbeat`)."""

    def record_heartbeat(self, trial_id: int) -> None: ...

    def get_heartbeat_interval(self) -> int | None: ...


def heartbeat_storage(storage: object, *, enabled: bool = True) -> HeartbeatStorage | None:
    """`storage` where it can record trial heartbeats, else None; with `enabled` only where
    its own heartbeats are on (a heartbeat interval set: Optuna's `is_heartbeat_enabled`).
    The launcher beats for trials it holds through a storage opened without an interval.
    Duck-typed, as Optuna's `BaseHeartbeat` lives in an internal module
    (`optuna.storages._heartbeat`) a release may move."""
    record = getattr(storage, "record_heartbeat", None)
    interval = getattr(storage, "get_heartbeat_interval", None)
    if not (callable(record) and callable(interval)):
        return None
    if enabled and interval() is None:
        return None
    return cast(HeartbeatStorage, storage)


def is_connection_error(exc: BaseException | None) -> bool:
    """True for errors a database restart causes; those are retried, others are not.

    Optuna wraps SQLAlchemy errors in StorageInternalError, so the cause chain is followed.
    """
    for _ in range(5):
        if exc is None:
            return False
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            return True
        if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# What a database that is restarting or briefly unreachable answers a new connection with
# (not a wrong name, role or password: those are one line at once).
TRANSIENT_CONNECT = (
    "connection refused",
    "server closed the connection",
    "could not connect",
    "the database system is",  # starting up, shutting down, in recovery mode, not yet ...
    "too many clients",  # many workers starting at once
    "terminating connection",
    "timeout expired",
)
# ... and what a wrong URL answers, which wins: libpq joins the errors of every address it
# tried (localhost as ::1 and 127.0.0.1), so a wrong name can come with "refused" too.
PERMANENT_CONNECT = (
    "does not exist",
    "authentication failed",
    "password",
    "no pg_hba.conf entry",
    "could not translate host name",
    "failed to resolve host",
    "name or service not known",
)


def transient_connect_error(exc: BaseException) -> bool:
    """Whether `open_storage` failed as a database that is restarting or briefly unreachable
    fails (not as a wrong name, role, password or host does)."""
    text = str(exc).lower()
    return (
        isinstance(exc, StorageError)
        and "cannot connect" in text
        and any(m in text for m in TRANSIENT_CONNECT)
        and not any(m in text for m in PERMANENT_CONNECT)
    )


def open_storage_when_up(
    spec: StorageSpec, give_up_after_s: float = 120.0, **kwargs: Any
) -> BaseStorage:
    """`open_storage`, retried while the database is restarting or briefly unreachable (a
    worker of a compose stack or a Kubernetes Job started beside it, or during a restart,
    spent its restarts exiting at once); any other error at once."""
    return with_db_retry(
        lambda: open_storage(spec, **kwargs),
        give_up_after_s=give_up_after_s,
        what=f"storage {spec.display}",
        transient=transient_connect_error,
    )


def with_db_retry(
    fn: Callable[[], T],
    *,
    give_up_after_s: float = 120.0,
    what: str = "storage",
    transient: Callable[[Exception], bool] | None = None,
) -> T:
    """Run `fn`, retrying connection errors (or those `transient` names) with backoff
    (0.5 s doubling to 8 s) for up to `give_up_after_s` seconds, then StorageError. Other
    errors pass through."""
    deadline = time.monotonic() + give_up_after_s
    delay = 0.5
    while True:
        try:
            return fn()
        except Exception as exc:
            if transient is not None:
                retry = transient(exc)
            else:
                db_error = (SQLAlchemyError, optuna.exceptions.StorageInternalError)
                retry = isinstance(exc, db_error) and is_connection_error(exc)
            if not retry:
                raise
            if time.monotonic() + delay > deadline:
                raise StorageError(
                    f"{what}: database unreachable for {give_up_after_s:.0f}s: {_one_line(exc)}"
                ) from exc
            warnings.warn(
                f"{what}: database unreachable, retrying in {delay:.1f}s",
                HpsearchWarning,
                stacklevel=2,
            )
            time.sleep(delay)
            delay = min(delay * 2, 8.0)


@contextlib.contextmanager
def _advisory_lock(engine: sa.Engine, name: str) -> Iterator[sa.Connection]:
    """A PostgreSQL session-level advisory lock, held on one connection of `engine`
    (yielded, so the locked section can read on it without taking a second one)."""
    with engine.connect() as conn:
        key = _lock_key(name)
        conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
        # A session lock outlives the transaction; a fresh one sees what the previous holder
        # committed even under REPEATABLE READ.
        conn.commit()
        try:
            yield conn
        finally:
            _advisory_unlock(conn, key)


def _advisory_unlock(conn: sa.Connection, key: int) -> None:
    """Release a session lock taken on `conn`, whatever the locked section left behind.

    A failed statement there leaves the transaction aborted, where the unlock itself would
    fail; the connection would then go back to a pool still holding the lock, and every
    other process would wait on it for good. So roll back first, and if the unlock still
    fails, close the database session, which releases its locks.
    """
    try:
        conn.rollback()
        conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
        conn.commit()
    except SQLAlchemyError:
        conn.invalidate()


@contextlib.contextmanager
def _schema_lock(spec: StorageSpec) -> Iterator[None]:
    """Optuna creates its tables on first connect; workers starting together on an empty
    database would race on it (duplicate type "studydirection"). Serialize that step."""
    if not spec.is_postgres:
        yield
        return
    eng = sa.create_engine(spec.url, **_one_shot_engine_kwargs(spec))
    try:
        with _advisory_lock(eng, "<schema>"):
            yield
    finally:
        eng.dispose()


def _lock_key(study_name: str) -> int:
    # pg_advisory_lock takes a signed 64-bit key.
    return int.from_bytes(
        hashlib.sha1(f"hpsearch:{study_name}".encode()).digest()[:8], "big", signed=True
    )


@contextlib.contextmanager
def study_lock(
    spec: StorageSpec, study_name: str, engine: sa.Engine | None = None
) -> Iterator[sa.Connection | None]:
    """Serializes "count trials, then ask" across processes so the budget is never overshot.

    PostgreSQL: a session-level advisory lock; yields the connection holding it, on which
    the section counts the trials (`count_trials_sql`). A trial the section creates through
    a `FastRDBStorage` on `engine` is inserted on that connection too, in the count's
    transaction: a restart that ends the lock fails the insert rather than letting it
    through on a new connection after another worker has counted (`budget_lock_held`).
    Journal or SQLite file: flock on a sibling lock file; yields None.
    """
    if spec.is_postgres:
        eng = (
            engine
            if engine is not None
            else sa.create_engine(spec.url, **_one_shot_engine_kwargs(spec))
        )
        with _advisory_lock(eng, study_name) as conn, budget_lock_held(conn):
            yield conn
        return
    # Not "<journal>.lock": that is Optuna's own open-lock file for journal writes, and
    # holding it here made every write inside this lock wait out Optuna's 30 s grace.
    lock_path = _ask_lock_path(spec)
    if lock_path is None:
        yield None
        return
    fd = _open_lock_file(lock_path, spec)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # NFS: an exclusive flock needs the file open for writing
            raise StorageError(
                f"storage {spec.display}: cannot lock {lock_path}: {exc.strerror or exc}"
            ) from exc
        try:
            yield None
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open_lock_file(path: Path, spec: StorageSpec) -> int:
    """The study's lock file, open for writing where it can be (made writable by everyone
    who may share the database: its content is nothing), else for reading, which flock
    takes on a local disk (another user's file); one line when neither opens."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)  # not the umask's 0644: other users' workers lock it too
        return fd
    except FileExistsError:
        pass
    except OSError as exc:
        raise StorageError(
            f"storage {spec.display}: cannot create {path}: {exc.strerror or exc}"
        ) from exc
    for flags in (os.O_RDWR, os.O_RDONLY):
        try:
            return os.open(path, flags)
        except PermissionError:
            continue
        except OSError as exc:
            raise StorageError(f"storage {spec.display}: cannot open {path}: {exc}") from exc
    raise StorageError(f"storage {spec.display}: {path}: no permission to open it")


def _ask_lock_path(spec: StorageSpec) -> Path | None:
    """The file `study_lock` flocks where the database has no lock of its own: beside the
    journal file, or the SQLite file (with none, parallel workers both counted a free
    place and ran past the budget); None for an in-memory SQLite database."""
    if spec.kind == "journal":
        return Path(spec.url + ".ask-lock")
    url = make_url(spec.url)
    if url.get_backend_name() != "sqlite":
        return None
    database = str(url.database or "")
    if url.query.get("uri") == "true":  # sqlite:///file:/x/db?mode=...&uri=true
        if "memory" in database:
            return None
        database = database.removeprefix("file:").split("?", 1)[0]
    if database in ("", ":memory:"):
        return None
    return Path(database + ".ask-lock")


def count_trials_sql(conn: sa.Connection, study: optuna.Study) -> dict[str, int]:
    """Trials of `study` by state ("complete", "running", ...), in one aggregate query.

    Reads Optuna's own `trials` table (it stores TrialState names) instead of loading every
    trial through the storage: the budget check under the study lock stays O(1) in the
    study's size. Never writes there.
    """
    rows = conn.execute(
        sa.text("SELECT state, count(*) FROM trials WHERE study_id = :sid GROUP BY state"),
        {"sid": study._study_id},
    ).fetchall()
    counts = {s.name.lower(): 0 for s in optuna.trial.TrialState}
    for state, n in rows:
        counts[str(getattr(state, "name", state)).lower()] = int(n)
    return counts


@dataclass(frozen=True)
class PendingParam:
    """A parameter the sampler drew, not yet written (see `deferred_params`)."""

    name: str
    internal: float  # Optuna's internal representation (a categorical's index)
    distribution: BaseDistribution


def _param_batching_backend(storage: BaseStorage) -> FastRDBStorage | None:
    """The PostgreSQL storage behind Optuna's cache wrapper, where a trial's params and
    attributes are written in one statement; None elsewhere (they are then written one by
    one, as Optuna does)."""
    backend = getattr(storage, "_backend", None)
    if isinstance(backend, FastRDBStorage) and backend.fast_sql() and hasattr(storage, "_studies"):
        return backend
    return None


@dataclass
class Drawn:
    """What the sampler wrote for one trial while `deferred_params` held it: the drawn
    params, and system attributes (TPE's constant liar shares its relative params there)."""

    params: list[PendingParam] = field(default_factory=list)
    system_attrs: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def deferred_params(trial: optuna.Trial) -> Iterator[Drawn]:
    """Collect the params that `trial.suggest_*` draws, and the system attributes the
    sampler sets on the trial, instead of writing each in its own transaction (a read of
    the trial, an insert and a commit each), so that `set_trial_attrs(..., drawn=...)`
    writes them with the trial's attributes in one.

    The sampler sees the params at once: `Trial` keeps drawn params in its own cached copy,
    and only this trial's writes are held. Other storages write them as usual (nothing is
    collected). A suggest retried after a connection error keeps what it had collected:
    the trial's cached copy returns the drawn values again without a second write.
    """
    drawn = Drawn()
    storage = trial.storage
    if _param_batching_backend(storage) is None:
        yield drawn
        return
    write_param = storage.set_trial_param
    write_system_attr = storage.set_trial_system_attr
    tid = trial._trial_id

    def collect(trial_id: int, name: str, internal: float, distribution: BaseDistribution) -> None:
        if trial_id != tid:
            write_param(trial_id, name, internal, distribution)
            return
        drawn.params.append(PendingParam(name, internal, distribution))

    def collect_system_attr(trial_id: int, key: str, value: Any) -> None:
        if trial_id != tid:
            write_system_attr(trial_id, key, value)
            return
        drawn.system_attrs[key] = value

    storage.set_trial_param = collect  # type: ignore[method-assign,assignment]
    storage.set_trial_system_attr = collect_system_attr  # type: ignore[method-assign]
    try:
        yield drawn
    finally:
        del storage.set_trial_param  # the class's methods again
        del storage.set_trial_system_attr


def set_trial_attrs(
    trial: optuna.Trial,
    attrs: dict[str, Any],
    constraints: dict[str, float] | None = None,
    drawn: Drawn | None = None,
) -> None:
    """User attributes, constraint values (`Trial.set_constraint`) and what
    `deferred_params` collected (params, the sampler's system attributes) of a running
    trial, in one transaction. On PostgreSQL that is one statement
    (`FastRDBStorage.write_running_trial`), where the public API takes a read and an upsert
    per key, each in its own commit (a worker sets about ten per trial), plus the read of
    the system attributes that set_constraint does first. Other storages, or an Optuna
    without these internals, take the public path."""
    constraints = constraints or {}
    params = drawn.params if drawn is not None else []
    sampler_attrs = drawn.system_attrs if drawn is not None else {}
    storage = trial.storage
    backend = _param_batching_backend(storage)
    try:
        from optuna.study._constrained_optimization import _CONSTRAINTS_KEY
    except ImportError:
        backend = None
    if backend is None:
        for p in params:
            storage.set_trial_param(trial._trial_id, p.name, p.internal, p.distribution)
        for key, value in sampler_attrs.items():
            storage.set_trial_system_attr(trial._trial_id, key, value)
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        for key, bound in constraints.items():
            trial.set_constraint(key, bound)
        return
    system: dict[str, Any] = {f"{_CONSTRAINTS_KEY}:{k}": float(v) for k, v in constraints.items()}
    system.update(sampler_attrs)
    study_id = trial.study._study_id
    known = getattr(storage, "_studies", {}).get(study_id)
    dists = known.param_distribution if known is not None else {}
    backend.write_running_trial(
        trial._trial_id,
        study_id,
        [(p.name, p.internal, p.distribution) for p in params],
        attrs,
        system,
        dists,
    )
    for p in params:  # as Optuna's cache does after a param write: checked once per study
        dists.setdefault(p.name, p.distribution)
    cached = getattr(trial, "_cached_frozen_trial", None)
    if cached is not None:  # what trial.user_attrs shows, as set_user_attr would keep it
        cached.user_attrs.update(attrs)
        cached.system_attrs.update(system)


def tell(
    study: optuna.Study,
    trial: optuna.Trial,
    values: float | list[float] | None = None,
    state: optuna.trial.TrialState | None = None,
) -> None:
    """`study.tell` without the read-back of the finished trial that `Study.tell` makes to
    return it (six queries on RDBStorage, unused here). Optuna's own optimize loop calls the
    same internal function; where it is gone, the public `study.tell`. Either way the next
    read of the trials is fresh (`expire_trial_reads`)."""
    try:
        from optuna.study._tell import _tell_with_warning
    except ImportError:
        study.tell(trial, values, state=state)
    else:
        _tell_with_warning(study=study, trial=trial, value_or_values=values, state=state)
    finally:
        expire_trial_reads(study)


TRIALS_REFRESH_S = 0.25  # seconds a worker's view of the other workers' trials may lag


def throttle_trial_reads(study: optuna.Study, min_interval_s: float = TRIALS_REFRESH_S) -> None:
    """Let this process re-read the study's other trials from the database at most every
    `min_interval_s`.

    Optuna's cache re-reads every unfinished trial (params, attributes, intermediate values)
    on each `get_all_trials`, which the sampler and pruner call several times per trial: with
    W workers that is W running trials re-read W times over, the cost that makes plain Optuna
    slow down past 8 workers. Sampling and pruning on a view of the others that is a quarter
    of a second old changes nothing for trials that take seconds to hours. This process's own
    trial is always read fresh (Optuna reads a running trial from the database), and the
    budget check does not go through this cache at all.

    A storage that is not Optuna's RDB cache wrapper is left alone.
    """
    storage = study._storage
    read = getattr(storage, "_read_trials_from_remote_storage", None)
    if read is None or not isinstance(getattr(storage, "_backend", None), RDBStorage):
        return
    last: dict[int, float] = {}  # study id -> time.monotonic() of the latest read's start
    interval = [min_interval_s]  # seconds; raised while a trial trains (relaxed_trial_reads)
    lock = threading.Lock()

    def read_now(study_id: int, older_than_s: float = 0.0) -> None:
        with lock:
            now = time.monotonic()
            before = last.get(study_id)
            if before is not None and now - before < older_than_s:
                return
            last[study_id] = now
        try:
            read(study_id)
        except BaseException:
            # The view is as old as before this read: a failed read (an outage) must not
            # make it look fresh, or a pruning decision would skip its own read on it.
            with lock:
                if last.get(study_id) == now:
                    if before is None:
                        del last[study_id]
                    else:
                        last[study_id] = before
            raise

    def throttled(study_id: int) -> None:
        read_now(study_id, interval[0])

    storage._hpsearch_read_now = read_now  # type: ignore[attr-defined]
    storage._hpsearch_read_at = last  # type: ignore[attr-defined]
    storage._hpsearch_interval = interval  # type: ignore[attr-defined]
    storage._read_trials_from_remote_storage = throttled  # type: ignore[attr-defined]


@contextlib.contextmanager
def relaxed_trial_reads(study: optuna.Study, max_age_s: float) -> Iterator[None]:
    """While a trial trains, let reads of the other trials on any thread of this process be
    served from a view up to `max_age_s` old (the trial's reporter refreshes it in the
    background after each report, `refresh_trials_now`). A storage without the throttle is
    left alone."""
    interval = getattr(study._storage, "_hpsearch_interval", None)
    if interval is None:
        yield
        return
    before = interval[0]
    interval[0] = max(before, max_age_s)
    try:
        yield
    finally:
        interval[0] = before


def expire_trial_reads(study: optuna.Study) -> None:
    """Make this process's next read of the study's trials go to the database, throttle or
    not: after its own tell, so its sampler sees the trial it just finished."""
    last = getattr(study._storage, "_hpsearch_read_at", None)
    if last is not None:
        last.pop(study._study_id, None)


def refresh_trials_now(study: optuna.Study, older_than_s: float = 0.0) -> None:
    """Bring this process's view of the study's trials up to date, throttle or not, unless
    it was read less than `older_than_s` ago; the throttle counts the view's age from this
    read."""
    storage = study._storage
    read_now = getattr(storage, "_hpsearch_read_now", None)
    if read_now is not None:
        read_now(study._study_id, older_than_s)
        return
    read = getattr(storage, "_read_trials_from_remote_storage", None)
    if read is not None:
        read(study._study_id)
