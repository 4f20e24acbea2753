"""`hpsearch dashboard`: optuna-dashboard on the configured storage."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hpsearch.errors import HpsearchError, StorageError
from hpsearch.storage import has_optuna_tables, open_storage, resolve_storage


def run_dashboard(
    storage: str | None,
    workdir: Path,
    host: str,
    port: int,
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Serve optuna-dashboard until interrupted (blocks); `on_listening(url)` once the
    storage is open and the address free."""
    try:
        from optuna_dashboard import run_server
    except ImportError as exc:
        raise HpsearchError(
            "optuna-dashboard is not installed: pip install optuna-dashboard"
        ) from exc
    from hpsearch.tracking.server import listen_problem

    spec = resolve_storage(storage, workdir)
    if not has_optuna_tables(spec):  # a reader: it creates no schema, nor a journal file
        raise StorageError(
            f"storage {spec.display}: holds no Optuna study yet; launch one first, or create "
            "the tables with hpsearch init-storage"
        )
    opened = open_storage(spec, pool_size=1, create=False)
    if (problem := listen_problem(host, port)) is not None:
        raise HpsearchError(f"--host/--port: {host}:{port}: cannot listen there: {problem}")
    if on_listening is not None:
        on_listening(f"http://{host}:{port}")
    run_server(opened, host=host, port=port)
