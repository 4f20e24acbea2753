"""Helpers shared by the tracking tests (a module with a unique name, unlike conftest)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
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


UUIDS = [f"GPU-{i}aaaaaaa-0000-0000-0000-00000000000{i}" for i in range(4)]
MIG = "MIG-11111111-2222-3333-4444-555555555555"
PID = 4242


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    uuid: str
    util: float = 90.0
    mem_used: int = 1024 * 1024 * 1024  # 1 GiB
    power_mw: int = 250_000
    temp: int = 60
    sm_clock: int = 1980
    energy_mj: float | None = 1_000_000.0  # None = not supported
    proc_util: dict[int, float] | None = field(default_factory=dict)  # None = not supported
    proc_mem: dict[int, int] = field(default_factory=dict)
    ts: int = 0
    # (pid, %) samples from before the sampler opened, in NVML's buffer: a query with
    # timestamp 0 returns them too
    buffered: list[tuple[int, float]] = field(default_factory=list)
    proc_error: int | None = None  # nvmlDeviceGetProcessUtilization raises this code
    hang_s: float = 0.0  # nvmlDeviceGetUtilizationRates takes this long (a GPU off the bus)
    forbidden: bool = False  # kept from this process (a cgroup): NO_PERMISSION to open it
    mem_error: int | None = None  # nvmlDeviceGetComputeRunningProcesses raises this code


class FakeNVML:
    """The NVML calls GpuSampler makes, over a list of fake GPUs."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[FakeGpu], *, init_error: bool = False) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialized = False
        self.shutdowns = 0
        self.queried: set[int] = set()
        self.hanging = threading.Event()  # a call is stuck in a GPU's hang_s

    def nvmlInit(self) -> None:
        if self.init_error:
            raise FakeNVMLError(12)  # library not found
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if self.gpus[i].forbidden:
            raise FakeNVMLError(4)  # NO_PERMISSION
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for i, g in enumerate(self.gpus):
            if g.uuid == uuid:
                return i
        raise FakeNVMLError(13)

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.gpus[h].uuid

    def _q(self, h: int) -> FakeGpu:
        self.queried.add(h)
        return self.gpus[h]

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        if self.gpus[h].hang_s:
            self.hanging.set()
            time.sleep(self.gpus[h].hang_s)
        return SimpleNamespace(gpu=self._q(h).util, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(used=self._q(h).mem_used, total=80 * 1024**3)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._q(h).power_mw

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == 0
        return self._q(h).temp

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        assert clock == 1
        return self._q(h).sm_clock

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> float:
        g = self._q(h)
        if g.energy_mj is None:
            raise FakeNVMLError(3)
        return g.energy_mj

    def nvmlDeviceGetProcessUtilization(self, h: int, last_seen: int) -> list[Any]:
        g = self._q(h)
        if g.proc_util is None:
            raise FakeNVMLError(3)
        if g.proc_error is not None:
            raise FakeNVMLError(g.proc_error)
        g.ts += 1_000_000
        old = [(pid, u, g.ts - 500_000) for pid, u in g.buffered] if last_seen == 0 else []
        if not g.proc_util and not old:
            raise FakeNVMLError(6)  # NOT_FOUND: no sample
        return [
            SimpleNamespace(pid=pid, smUtil=u, memUtil=0, timeStamp=ts)
            for pid, u, ts in [*old, *((pid, u, g.ts) for pid, u in g.proc_util.items())]
        ]

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        g = self._q(h)
        if g.mem_error is not None:
            raise FakeNVMLError(g.mem_error)
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in g.proc_mem.items()]
