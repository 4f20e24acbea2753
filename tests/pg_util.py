"""A PostgreSQL URL that behaves as a server restarting for real: its port first refuses
connections (nothing listens) or drops them (libpq: "server closed the connection
unexpectedly"), then forwards them to the machine's server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import sqlalchemy as sa
from sqlalchemy.engine import make_url


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def url_up_later(pg_url: str, after_s: float, *, drop: bool = False) -> str:
    """`pg_url` behind a free local port that, for `after_s` seconds, refuses connections
    (or, with `drop`, accepts and closes them at once, for `after_s` seconds from the first
    one: however late a loaded machine starts the client), then forwards each to the real
    server. The forwarder is a daemon thread: it lives as long as the test process."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))  # bound, not listening: refused, and the port kept ours
    port = server.getsockname()[1]
    real = make_url(pg_url)

    def serve() -> None:
        if not drop:
            time.sleep(after_s)
        server.listen()
        up_at: float | None = None if drop else 0.0
        while True:
            client, _ = server.accept()
            if up_at is None and client.recv(1, socket.MSG_PEEK):  # a client's first bytes
                up_at = time.monotonic() + after_s
            if up_at is None or time.monotonic() < up_at:
                client.close()
                continue
            upstream = socket.create_connection((real.host or "127.0.0.1", real.port or 5432))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    if drop:  # listening before the caller connects: its first tries are dropped, not refused
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with socket.socket() as s, contextlib.suppress(OSError):
                s.connect(("127.0.0.1", port))  # sends nothing: does not start the window
                break
            time.sleep(0.01)
    return real.set(port=port).render_as_string(hide_password=False)


def _admin(url: str) -> sa.Engine:
    """The server's `postgres` database, to end or refuse the sessions of `url`'s."""
    from hpsearch.storage import normalize_url

    return sa.create_engine(
        normalize_url(url.rsplit("/", 1)[0] + "/postgres"),
        isolation_level="AUTOCOMMIT",
        poolclass=sa.pool.NullPool,
    )


def terminate_backends(url: str) -> None:
    """End every session of the database, as a restart does (their advisory locks too)."""
    admin = _admin(url)
    with admin.connect() as c:
        c.execute(
            sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
            {"n": url.rsplit("/", 1)[1]},
        )
    admin.dispose()


def cut_off(url: str, seconds: float) -> threading.Thread:
    """Make the database unreachable for `seconds`: new connections refused, current ones
    terminated (what a restart or a network cut does to a worker), on a thread."""
    name = url.rsplit("/", 1)[1]
    admin = _admin(url)

    def outage() -> None:
        with admin.connect() as c:
            c.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
        terminate_backends(url)
        time.sleep(seconds)
        with admin.connect() as c:
            c.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()

    thread = threading.Thread(target=outage)
    thread.start()
    return thread
