"""`hpsearch dashboard`: optuna-dashboard on the configured storage."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hpsearch.errors import HpsearchError, StorageError
from hpsearch.storage import (
    has_optuna_tables,
    open_storage,
    resolve_storage,
    transient_connect_error,
    with_db_retry,
)

T = TypeVar("T")

# s a database that is restarting or not up yet is waited for (a compose stack starts the
# dashboard beside PostgreSQL; a restart closes connections), as a worker waits for it.
DB_WAIT_S = 120.0


def run_dashboard(
    storage: str | None,
    workdir: Path,
    host: str,
    port: int,
    on_listening: Callable[[str], None] | None = None,
    db_wait_s: float = DB_WAIT_S,
) -> None:
    """Serve optuna-dashboard until interrupted (blocks); `on_listening(url)` once the
    storage is open and the address free. A database that refuses or drops connections as
    a restarting one does is retried for `db_wait_s`; a wrong name, role or host is not."""
    try:
        from optuna_dashboard import run_server
    except ImportError as exc:
        raise HpsearchError(
            "optuna-dashboard is not installed: pip install optuna-dashboard"
        ) from exc
    from hpsearch.tracking.server import free_port_hint, listen_problem

    spec = resolve_storage(storage, workdir)

    def when_up(fn: Callable[[], T]) -> T:
        return with_db_retry(
            fn, give_up_after_s=db_wait_s, what=f"storage {spec.display}",
            transient=transient_connect_error,
        )  # fmt: skip

    # A reader: it creates no schema, nor a journal file. A file named that is not there is
    # a typo, said as `status` says it (QA: "holds no Optuna study yet").
    from hpsearch.query import missing_file

    if (missing := missing_file(spec, storage)) is not None:
        raise missing
    if not when_up(lambda: has_optuna_tables(spec)):
        raise StorageError(
            f"storage {spec.display}: holds no Optuna study yet; launch one first, or create "
            "the tables with hpsearch init-storage"
        )
    opened = when_up(lambda: open_storage(spec, pool_size=1, create=False, pre_ping=True))
    if (problem := listen_problem(host, port)) is not None:
        raise HpsearchError(
            f"--host/--port: {host}:{port}: cannot listen there: {problem}{free_port_hint(host)}"
        )
    if on_listening is not None:
        on_listening(f"http://{host}:{port}")
    run_server(opened, host=host, port=port)
