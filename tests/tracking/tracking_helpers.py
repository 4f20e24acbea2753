"""Helpers shared by the tracking tests (a module with a unique name, unlike conftest)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag


class CountingClient(MlflowClient):
    """An MlflowClient that records every log_batch request (run id, #metrics, #params, #tags)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[str, int, int, int]] = []

    def log_batch(
        self,
        run_id: str,
        metrics: Sequence[Metric] = (),
        params: Sequence[Param] = (),
        tags: Sequence[RunTag] = (),
        synchronous: bool | None = None,
    ) -> Any:
        result = super().log_batch(run_id, metrics, params, tags, synchronous=synchronous)
        self.batches.append((run_id, len(metrics), len(params), len(tags)))
        return result


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def group_members(pgid: int) -> list[int]:
    """PIDs whose process group is ``pgid`` (from /proc; zombies excluded)."""
    out: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out
