"""Optuna's gRPC storage proxy in front of the PostgreSQL study database (compose profile `grpc`).

With hundreds of workers, each holding its own small connection pool, PostgreSQL runs out of
connections and spends its time on the same reads; the proxy keeps one pool and an in-process
cache, and the workers talk gRPC to it (optuna.storages.GrpcStorageProxy).

Environment: HPSEARCH_STORAGE (the PostgreSQL URL, password included; never printed),
GRPC_HOST (default 0.0.0.0), GRPC_PORT (default 13000), GRPC_THREADS (default 32).
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import optuna
from optuna.storages import get_storage, run_grpc_proxy_server
from sqlalchemy.engine import make_url


def main() -> None:
    url = os.environ.get("HPSEARCH_STORAGE", "")
    if not url.startswith(("postgresql", "postgres")):
        sys.exit("grpc_proxy: set HPSEARCH_STORAGE to the postgresql:// URL of the study database")
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):  # SQLAlchemy 2.1 would pick psycopg 3 for a bare URL
        url = "postgresql+psycopg2://" + url[len("postgresql://") :]
    host = os.environ.get("GRPC_HOST", "0.0.0.0")
    port = int(os.environ.get("GRPC_PORT", "13000"))
    threads = int(os.environ.get("GRPC_THREADS", "32"))
    # get_storage wraps RDBStorage in Optuna's cache, which the proxy is meant to have.
    storage = get_storage(
        optuna.storages.RDBStorage(
            url,
            engine_kwargs={"pool_pre_ping": True, "pool_size": threads, "max_overflow": 4},
        )
    )
    shown = make_url(url).render_as_string(hide_password=True)
    print(f"grpc_proxy: optuna {optuna.__version__}, {shown} on {host}:{port}", flush=True)
    run_grpc_proxy_server(storage, host=host, port=port, thread_pool=ThreadPoolExecutor(threads))


if __name__ == "__main__":
    main()
