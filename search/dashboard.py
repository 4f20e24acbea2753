"""`hpsearch dashboard`: optuna-dashboard on the configured storage."""

from __future__ import annotations

from pathlib import Path

from hpsearch.errors import HpsearchError
from hpsearch.storage import open_storage, resolve_storage


def run_dashboard(storage: str | None, workdir: Path, host: str, port: int) -> None:
    """Serve optuna-dashboard until interrupted (blocks)."""
    try:
        from optuna_dashboard import run_server
    except ImportError as exc:
        raise HpsearchError(
            "optuna-dashboard is not installed: pip install optuna-dashboard"
        ) from exc
    spec = resolve_storage(storage, workdir)
    run_server(open_storage(spec, pool_size=1), host=host, port=port)
