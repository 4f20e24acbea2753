"""Fixtures: one real ``mlflow server`` subprocess for the whole test session (tests that stop
servers start their own), clients talking to it over HTTP, and a unique experiment per test."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_util import group_alive
from hpsearch.tracking.mlflow_logger import apply_http_policy
from hpsearch.tracking.server import LocalServer, start_local_server
from tracking_helpers import CountingClient

apply_http_policy()  # short MLflow HTTP retries for the test process too


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    workdir = tmp_path_factory.mktemp("shared-store")
    server = start_local_server(workdir)
    try:
        yield server
    finally:
        server.stop()
        assert not group_alive(server.pgid)


@pytest.fixture
def client(mlflow_server: LocalServer) -> CountingClient:
    return CountingClient(tracking_uri=mlflow_server.url)


@pytest.fixture
def experiment_id(client: CountingClient) -> str:
    return str(client.create_experiment(f"test-{uuid.uuid4().hex[:10]}"))


@pytest.fixture
def tracking_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="hpsearch.tracking")
    return caplog


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path / "work"
