"""GPU packing (--workers auto): the pure decisions, the memory ledger, and the worker's
admission control. The probe itself needs a CUDA GPU; here it must fail with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hpsearch import launcher
from hpsearch.config import load_config
from hpsearch.errors import DeviceError
from hpsearch.packing import (
    AdmissionStopped,
    GpuLedger,
    MemoryModel,
    MiB,
    PackingPlan,
    admit,
    busy_fraction,
    busy_from_step_times,
    first_in_line,
    fit_memory,
    gpu_env,
    gpus_through_mask,
    place_workers,
    plan_from_probe,
    process_start,
    reference_batch,
    visible_gpus,
    workers_per_gpu,
)
from hpsearch.probe import (
    data_bytes,
    image_sizes,
    probe_shapes,
    time_speed_batches,
    train_steps,
    warm_data_bytes,
)
from hpsearch.storage import StorageSpec
from hpsearch.trainer import TrainOptions, WarmCache, train
from hpsearch.worker import WorkerOptions, run_worker

GiB = 1 << 30


def test_fit_memory_is_a_line_through_the_probe_points() -> None:
    m = fit_memory("resnet18", 128, (32, 1 * GiB), (256, 8 * GiB), context_bytes=512 * MiB)
    assert m.trial_bytes(32, 128) == pytest.approx(1 * GiB, rel=1e-6)
    assert m.trial_bytes(256, 128) == pytest.approx(8 * GiB, rel=1e-6)
    # activations scale with pixels: twice the side, four times the per-image part
    per_image = m.per_sample_bytes
    assert m.trial_bytes(64, 256) - m.fixed_bytes == pytest.approx(4 * 64 * per_image, rel=1e-6)
    with pytest.raises(ValueError, match="must grow"):
        fit_memory("x", 64, (64, 1), (32, 2), 0)


def test_busy_fraction_from_step_times() -> None:
    # The issue's H200 figures: ResNet-18 at 128 px, batch 32 takes 8.4 ms a step (launch
    # bound), batch 256 runs 23,600 images/s (10.8 ms a step).
    busy = busy_fraction(0.0084, 32, 256 / 23600, 256)
    assert 0.15 < busy < 0.17
    assert busy_fraction(0.01, 256, 0.01, 256) == 1.0
    assert busy_fraction(0.0, 32, 0.01, 256) == 1.0  # no timing: assume busy, pack nothing


def test_reference_batch_grows_past_the_study_until_memory_says_stop() -> None:
    # 10 MiB per image at the probe's size, 1 GiB fixed
    m = MemoryModel("resnet18", 128, GiB, 10 * MiB, 512 * MiB)
    assert reference_batch(128, m, 140 * GiB) == 512  # 4x the study's largest fits
    # 512 needs 6 GiB: half of a 12 GiB card holds it, half of an 11 GiB one only 256 (3.5)
    assert reference_batch(128, m, 12 * GiB) == 512
    assert reference_batch(128, m, 11 * GiB) == 256
    assert reference_batch(128, m, GiB) == 128  # never below the study's largest


def test_busy_from_step_times_compares_against_the_fastest_batch() -> None:
    # The H200's ResNet-18 at 128 px (bench/results/h200-trainer.json): launch-bound at about
    # 9.1 ms a step up to batch 128 or so, 26,700 images/s at batch 256 and beyond.
    def step(batch: int) -> float:
        return max(0.0091, batch / 26700)

    # A study with one batch size (64): the old probe had nothing to compare with and
    # reported 100% busy, so `--workers auto` packed one worker where four gave 2.8x.
    one = {64: step(64), 256: step(256)}
    busy = busy_from_step_times(one, 64)
    assert 0.2 < busy < 0.3
    assert workers_per_gpu(140 * GiB, 2 * GiB, GiB // 2, busy) == 4
    # flowers102's 32/64/128: the largest is not saturating either; the reference is
    times = {b: step(b) for b in (32, 64, 128, 512)}
    assert busy_from_step_times(times, 64) == pytest.approx(busy, rel=1e-6)
    assert busy_from_step_times({128: step(128)}, 128) == 1.0  # alone: nothing to compare
    assert busy_from_step_times({128: step(128)}, 64) == 1.0  # the batch was not timed


def test_workers_per_gpu_takes_the_tighter_limit() -> None:
    # compute bound: a worker keeps the GPU 30% busy -> 4 fill it (0.95 / 0.3 = 3.2)
    assert workers_per_gpu(140 * GiB, 4 * GiB, GiB // 2, busy=0.3) == 4
    # memory bound: 20 GiB trials on a 40 GiB GPU leave room for one
    assert workers_per_gpu(40 * GiB, 20 * GiB, GiB // 2, busy=0.1) == 1
    # the cap
    assert workers_per_gpu(140 * GiB, GiB, GiB // 2, busy=0.05, max_workers=6) == 6
    # never zero, even when one trial alone does not fit
    assert workers_per_gpu(8 * GiB, 20 * GiB, GiB, busy=0.1) == 1


def test_place_workers_interleaves_gpus() -> None:
    assert place_workers({"0": 3, "1": 3}) == ["0", "1", "0", "1", "0", "1"]
    assert place_workers({"2": 2}) == ["2", "2"]


def test_admit() -> None:
    assert admit(100 * GiB, {}, 80 * GiB)  # alone on the GPU: always, an OOM is recorded
    assert admit(30 * GiB, {1: 40 * GiB}, 80 * GiB)  # 70 <= 72
    assert not admit(40 * GiB, {1: 40 * GiB}, 80 * GiB)


def test_visible_gpus() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    # As CUDA reads a mask: up to the first invalid or repeated entry ("-1" hides them all;
    # it was taken for a GPU named "-1", and --workers N put CPU workers on it).
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ["0"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,1,2"}) == ["1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,00,1"}) == ["0"]  # "00" is GPU 0 again
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "01"}) == ["1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "\u00b2"}) == []  # a digit, not an index
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f2c,MIG-ab12, 3"}) == [
        "GPU-8f2c", "MIG-ab12", "3",
    ]  # fmt: skip
    assert visible_gpus({}, count=lambda: 2) == ["0", "1"]

    def no_driver() -> int:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    assert visible_gpus({}, count=no_driver) == []


def test_gpus_count_among_the_visible_ones() -> None:
    """Under a parent's CUDA_VISIBLE_DEVICES, `--gpus 1` is its second visible GPU, and a
    worker's own mask must name that GPU's id, not index 1 of the whole machine."""
    assert gpus_through_mask(["0", "1"], {"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert gpus_through_mask(["1"], {"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}) == ["GPU-b2"]
    assert gpus_through_mask(["1", "GPU-c3"], {}) == ["1", "GPU-c3"]
    assert gpus_through_mask(["GPU-b2ff"], {"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}) == [
        "GPU-b2ff"
    ]
    with pytest.raises(DeviceError, match=r"--gpus: GPU-c3: not among the visible GPUs"):
        gpus_through_mask(["GPU-c3"], {"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"})
    with pytest.raises(DeviceError, match=r"--gpus: GPU-a1: not among the visible GPUs"):
        gpus_through_mask(["GPU-a1"], {"CUDA_VISIBLE_DEVICES": ""})
    with pytest.raises(DeviceError, match=r"--gpus: 2: only 2 GPU\(s\) visible"):
        gpus_through_mask(["2"], {"CUDA_VISIBLE_DEVICES": "2,3"})


def test_gpu_env_keeps_the_users_device_order_and_defaults_to_nvmls() -> None:
    # NVML's indices (no mask of the user's) are in PCI bus order: CUDA is told so.
    assert gpu_env({"PATH": "/bin"}, "3") == {
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "3",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    # The user's mask means what it means to CUDA under their order (unset: fastest first);
    # an order set here would move "3" to another GPU on a machine with unlike GPUs.
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3"}
    env = gpu_env(base, "3")
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3"}
    assert base == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3"}  # not changed
    # The user's order is what their mask and `--gpus` count in: kept, for the probe too.
    assert gpu_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, "1") == {
        "CUDA_DEVICE_ORDER": "FASTEST_FIRST",
        "CUDA_VISIBLE_DEVICES": "1",
    }
    assert gpu_env({"CUDA_VISIBLE_DEVICES": "0"}, None)["CUDA_VISIBLE_DEVICES"] == "0"


def test_the_probe_and_the_workers_get_the_same_gpu_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Both count GPUs in the user's CUDA_DEVICE_ORDER, so the probed GPU is the one the
    first workers train on."""
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    seen: list[dict[str, str]] = []

    def fake_run(cmd: list[str], env: dict[str, str], **kwargs: object) -> object:
        seen.append(env)
        raise subprocess.TimeoutExpired(cmd, 1.0)

    monkeypatch.setattr(launcher.subprocess, "run", fake_run)
    monkeypatch.setenv("HPSEARCH_DATA_DIR", "/elsewhere")  # the resolved file's folder wins
    with pytest.raises(DeviceError, match="the GPU probe took over"):
        launcher.auto_workers(tmp_path / "s.yaml", ["1", "0"], tmp_path, timeout_s=1.0)
    assert "HPSEARCH_DATA_DIR" not in seen[0]
    worker = launcher.worker_env(os.environ, "postgresql://u:secret@h/db", "1", None)
    assert (worker["CUDA_DEVICE_ORDER"], worker["CUDA_VISIBLE_DEVICES"]) == ("FASTEST_FIRST", "1")
    # The probe trains on its device 0, the first workers' GPU; it sees the launch's other
    # GPUs after it, to read their free memory.
    assert (seen[0]["CUDA_DEVICE_ORDER"], seen[0]["CUDA_VISIBLE_DEVICES"]) == (
        "FASTEST_FIRST",
        "1,0",
    )
    assert worker["HPSEARCH_STORAGE"] == "postgresql://u:secret@h/db"
    # The resolved study file holds the launch's data folder; the variable would win over it.
    monkeypatch.setenv("HPSEARCH_DATA_DIR", "/elsewhere")
    assert "HPSEARCH_DATA_DIR" not in launcher.worker_env(os.environ, "postgresql:///db", "1", None)
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cpu = launcher.worker_env(os.environ, "postgresql:///db", None, 1)
    # The user's mask keeps CUDA's meaning (no order set for it); their thread count too.
    assert "CUDA_DEVICE_ORDER" not in cpu and cpu["OMP_NUM_THREADS"] == "3"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert launcher.worker_env(os.environ, "postgresql:///db", None, 2)["OMP_NUM_THREADS"] == "2"


def test_a_launchs_workers_are_told_when_their_mlflow_is_its_embedded_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Their runs kept while it is down go to its spool folder (runs.spool_folder), which
    the next launch sends whatever port it gives the server; a worker on another server
    must not inherit the word from the environment of a launch's worker."""
    from hpsearch.tracking.server import EMBEDDED_TRACKING_ENV, told_embedded

    monkeypatch.setenv(EMBEDDED_TRACKING_ENV, "1")
    db, remote, own = "postgresql:///db", "https://mlflow.example.com", "http://127.0.0.1:5000"
    assert EMBEDDED_TRACKING_ENV not in launcher.worker_env(os.environ, db, None, 1, remote)
    told = launcher.worker_env(os.environ, db, None, 1, own, embedded_tracking=True)
    assert told[EMBEDDED_TRACKING_ENV] == "1" and told["MLFLOW_TRACKING_URI"] == own
    untracked = launcher.worker_env(os.environ, db, None, 1, None, embedded_tracking=True)
    assert EMBEDDED_TRACKING_ENV not in untracked
    # What the worker reads back: told, unless its own --tracking-uri names a server.
    assert told_embedded(told, None)
    assert not told_embedded(told, own)
    assert not told_embedded(launcher.worker_env({}, db, None, 1, remote), None)


class _ProbeNVML:
    """The NVML calls the probe's `_context_bytes` makes: two GPUs, this process on one."""

    def __init__(self, uuids: list[str], ours: int, used: int) -> None:
        self.uuids, self.ours, self.used = uuids, ours, used

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return self.uuids.index(uuid)

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self.uuids[handle]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[object]:
        if handle != self.ours:
            return []
        return [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.used)]


class _FreeNVML(_ProbeNVML):
    """NVML's memory figures too: GPU `full` answers nothing."""

    def __init__(self, uuids: list[str], free: list[int], full: int) -> None:
        super().__init__(uuids, ours=0, used=0)
        self.free, self.full = free, full

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:
        if handle == self.full:
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return types.SimpleNamespace(free=self.free[handle], total=80 * GiB)


def test_the_probe_reads_each_gpus_free_memory_through_nvml_without_a_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA's devices, in CUDA's order, found in NVML by UUID: a context made on every GPU to
    ask it (torch.cuda.mem_get_info) failed on a full one and failed the whole probe."""
    import torch
    from hpsearch import probe

    uuids = [f"GPU-{k}aaaaaaa-0000-0000-0000-00000000000{k}" for k in range(3)]
    nvml = _FreeNVML(uuids, free=[10 * GiB, 20 * GiB, 30 * GiB], full=1)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    order = [2, 1, 0]  # CUDA's devices 0, 1, 2 are NVML's 2, 1, 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: types.SimpleNamespace(uuid=uuids[order[i]].removeprefix("GPU-")),
    )

    def no_context(*args: object) -> object:
        raise AssertionError("a CUDA context was made to read free memory")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)
    assert probe.free_bytes_of_visible_gpus() == [30 * GiB, None, 10 * GiB]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML: all unknown, nothing raised
    assert probe.free_bytes_of_visible_gpus() == [None, None, None]


def test_a_plan_adds_back_what_other_workers_of_the_work_folder_reserved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Another study's workers in the same work folder use memory the probe sees as taken,
    and hold it in the same ledger: counted once, not twice (a second study's trials then
    waited an hour for room and failed)."""
    models = [MemoryModel("resnet50", 224, 16 * GiB, 0, 1536 * MiB)]
    probe_out = {
        "total_bytes": 80 * GiB, "worst_trial_bytes": 16 * GiB, "busy": 0.1, "data_bytes": 0,
        "models": [m.__dict__ for m in models], "free_bytes": [45 * GiB, None],
    }  # fmt: skip

    def fake_run(cmd: list[str], **kwargs: object) -> object:
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(probe_out))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(launcher.subprocess, "run", fake_run)
    need = 16 * GiB + 1536 * MiB
    assert GpuLedger(tmp_path, "0", 80 * GiB).try_reserve(2 * need, pid=os.getppid())
    plan = launcher.auto_workers(tmp_path / "s.yaml", ["0", "1"], tmp_path)
    # Each study's own plan: another study's workers size their trials by theirs.
    assert launcher.packing_path(tmp_path / "s.yaml") == tmp_path / "s.packing.json"
    assert PackingPlan.from_json((tmp_path / "s.packing.json").read_text()) == plan
    assert plan.bytes_on("0") == 45 * GiB + 2 * need
    assert plan.workers_on("0") == 2  # 0.9 x 45 GiB free: 2 of 17.5 GiB
    assert plan.bytes_on("1") == 80 * GiB  # unknown: planned like the first GPU's total
    ledger = GpuLedger(tmp_path, "0", plan.bytes_on("0"))
    assert ledger.try_reserve(need, pid=os.getpid())  # waited for good before


def test_the_probe_measures_its_context_on_the_gpu_cuda_gave_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA's device 0 is found in NVML by its UUID, whatever the device order: here NVML's
    GPU 1, where NVML lists this process; on GPU 0 it would find nothing (the fallback)."""
    import torch
    from hpsearch import probe

    uuids = ["GPU-0aaaaaaa-0000-0000-0000-000000000000", "GPU-1bbbbbbb-0000-0000-0000-000000000001"]
    monkeypatch.setitem(sys.modules, "pynvml", _ProbeNVML(uuids, ours=1, used=900 << 20))
    props = types.SimpleNamespace(uuid="1bbbbbbb-0000-0000-0000-000000000001")  # torch's form
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 300 << 20)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert probe._context_bytes() == 600 << 20
    props.uuid = "0aaaaaaa-0000-0000-0000-000000000000"  # NVML's GPU 0: this PID is not there
    assert probe._context_bytes() == probe.CONTEXT_FALLBACK
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuids[1])  # a UUID names it to both
    assert probe._context_bytes() == 600 << 20


def test_plan_round_trip_and_reason() -> None:
    models = [MemoryModel("resnet18", 112, GiB, 20 * MiB, 512 * MiB)]
    plan = plan_from_probe(["0"], 140 * GiB, models, 6 * GiB, busy=0.25, max_per_gpu=8)
    assert plan.workers_per_gpu == 4
    assert "4 workers per GPU" in plan.reason and "compute" in plan.reason
    again = PackingPlan.from_json(plan.to_json())
    assert again == plan
    assert again.trial_bytes("resnet18", 64, 112) == GiB + 64 * 20 * MiB + 512 * MiB
    assert again.trial_bytes("resnet50", 64, 112) is None


def test_unlike_or_busy_gpus_get_workers_and_reservations_by_their_free_memory(
    tmp_path: Path,
) -> None:
    # An 80 GiB card and a 40 GiB one (or one holding another job's 40 GiB): a trial needs
    # 17.5 GiB with its context. Packing both like the first ran the second out of memory.
    models = [MemoryModel("resnet50", 224, 16 * GiB, 0, 1536 * MiB)]
    plan = plan_from_probe(
        ["0", "1"], 80 * GiB, models, 16 * GiB, busy=0.1, max_per_gpu=8,
        free_bytes=[80 * GiB, 40 * GiB],
    )  # fmt: skip
    assert plan.workers_on("0") == 4 and plan.workers_on("1") == 2
    assert place_workers({g: plan.workers_on(g) for g in plan.gpus}) == ["0", "1"] * 2 + ["0"] * 2
    assert "4 on 0" in plan.reason and "2 on 1" in plan.reason
    again = PackingPlan.from_json(plan.to_json())
    assert again == plan and again.bytes_on("1") == 40 * GiB
    # The second GPU's ledger admits by its own memory: a third 17.5 GiB trial never fits.
    need = 16 * GiB + 1536 * MiB
    ledger = GpuLedger(tmp_path, "1", again.bytes_on("1"))
    assert ledger.try_reserve(need, pid=os.getpid())
    assert ledger.try_reserve(need, pid=os.getppid())
    assert not GpuLedger(tmp_path, "1", again.bytes_on("1")).try_reserve(need, pid=1)
    # A plan without per-GPU figures (an older version's, or free memory unknown) packs
    # every GPU like the first.
    old = plan_from_probe(["0", "1"], 80 * GiB, models, 16 * GiB, busy=0.1, max_per_gpu=8)
    assert old.gpu_bytes == {} and old.workers_on("1") == 4 and old.bytes_on("1") == 80 * GiB
    raw = json.loads(old.to_json())
    del raw["gpu_bytes"], raw["gpu_workers"]
    assert PackingPlan.from_json(json.dumps(raw)).workers_on("1") == 4
    # Another job holds most of GPU 1: 4 GiB free cannot hold the 17.5 GiB trial. A worker
    # there, alone, was admitted every trial and ran the large ones out of memory.
    full = plan_from_probe(
        ["0", "1"], 80 * GiB, models, 16 * GiB, busy=0.1, max_per_gpu=8,
        free_bytes=[80 * GiB, 4 * GiB],
    )  # fmt: skip
    assert full.workers_on("0") == 4 and full.workers_on("1") == 0
    assert place_workers({g: full.workers_on(g) for g in full.gpus}) == ["0"] * 4
    assert "no worker on 1 (4096 MiB free)" in full.reason, full.reason
    # When no GPU can hold it, each still gets one worker (smaller trials fit), and says so.
    none = plan_from_probe(
        ["0", "1"], 80 * GiB, models, 16 * GiB, busy=0.1, max_per_gpu=8,
        free_bytes=[8 * GiB, 4 * GiB],
    )  # fmt: skip
    assert none.workers_on("0") == 1 and none.workers_on("1") == 1
    assert "no GPU has room for the largest trial" in none.reason
    # The larger card second (a 40 GiB one first): planned by its own 80 GiB, not the
    # first card's total (it got 2 workers and a 40 GiB ledger).
    larger = plan_from_probe(
        ["0", "1"], 40 * GiB, models, 16 * GiB, busy=0.1, max_per_gpu=8,
        free_bytes=[40 * GiB, 80 * GiB],
    )  # fmt: skip
    assert larger.workers_on("0") == 2 and larger.workers_on("1") == 4
    assert larger.bytes_on("1") == 80 * GiB
    # What the work folder's workers hold is added back, but never past the card: a
    # reservation not yet allocated is in NVML's free figure too.
    held = plan_from_probe(
        ["0", "1"], 40 * GiB, models, 16 * GiB, busy=0.1, max_per_gpu=8,
        free_bytes=[30 * GiB, 80 * GiB], reserved_bytes={"0": 20 * GiB, "1": 10 * GiB},
    )  # fmt: skip
    assert held.bytes_on("0") == 40 * GiB and held.bytes_on("1") == 80 * GiB


def test_probe_shapes_of_the_headline_study() -> None:
    cfg = load_config("flowers102")
    archs, size, small, mid, large = probe_shapes(cfg)
    assert archs and all(a.startswith("resnet") for a in archs)
    assert size >= cfg.dataset.image_size
    assert (small, mid, large) == (128, 128, 256)  # its batch_size choices: the lower two


def test_probe_judges_busy_at_a_batch_trials_use() -> None:
    """Of two choices the lower (the upper was the largest, the most saturating: a study of
    small batches got about one worker per GPU); of a range its geometric middle."""
    assert probe_shapes(load_config("tiny"))[2:] == (32, 32, 64)  # choices [32, 64]
    ranged = load_config("tiny", ["search_space.batch_size={type: int, low: 16, high: 256}"])
    assert probe_shapes(ranged)[2:] == (16, 64, 256)
    capped = load_config("tiny", ["trainer.max_micro_batch=48"])
    assert probe_shapes(capped)[2:] == (32, 32, 48)


def test_probe_training_step_runs_every_arch_of_the_study_on_cpu() -> None:
    """The probe's step (model, optimizer, autocast, channels_last) for each architecture the
    headline study may pick; on a GPU the same code also reads the peak memory."""
    cfg = load_config("flowers102")
    archs = probe_shapes(cfg)[0]
    for arch in archs:
        peak, step_s = train_steps(cfg, arch, 2, 32, steps=1, device_name="cpu")
        assert peak == 0 and step_s > 0


def test_probe_times_the_worker_batch_and_a_reference_four_times_the_largest() -> None:
    """The probe's timing on the CPU for a study with one batch size (the packing bench's
    case): the worker's batch alone says nothing about how busy it keeps the GPU, so a
    reference batch is timed too, and the busy estimate compares the two."""
    cfg = load_config(
        "tiny", ["search_space={}", "trainer.defaults.batch_size=2", "dataset.image_size=32"]
    )
    archs, size, small, mid, large = probe_shapes(cfg)
    assert (small, mid, large) == (2, 2, 2)
    model = MemoryModel(archs[0], size, 0, MiB, 0)
    ref = reference_batch(large, model, 140 * GiB)
    assert ref == 8
    times = time_speed_batches(cfg, model, mid, ref, large, 1, {}, device_name="cpu")
    assert sorted(times) == [2, 8] and all(t > 0 for t in times.values())
    assert time_speed_batches(cfg, model, mid, ref, large, 1, times, device_name="cpu") == {}
    assert 0.0 < busy_from_step_times(times, mid) <= 1.0


def test_probe_halves_a_reference_batch_that_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory (or a cuDNN workspace error, a RuntimeError) at the reference batch:
    the probe tries half of it while that stays above the study's largest, instead of
    failing the launch or falling back to "100% busy"."""
    import hpsearch.probe as probe
    import torch

    cfg = load_config("tiny")
    tried: list[int] = []

    def fake_steps(cfg: object, arch: str, batch: int, size: int, steps: int,
                   device_name: str = "cuda") -> tuple[int, float]:  # fmt: skip
        tried.append(batch)
        if batch >= 512:
            raise torch.OutOfMemoryError("CUDA out of memory")
        if batch == 256:
            raise RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR")
        return 0, max(0.0091, batch / 26700)

    monkeypatch.setattr(probe, "train_steps", fake_steps)
    model = MemoryModel("resnet18", 128, GiB, MiB, 0)
    times = probe.time_speed_batches(cfg, model, 64, 1024, 128, 1, {128: 0.0091})
    assert tried == [64, 1024, 512, 256]  # 128 is the study's own largest: known, not retried
    assert sorted(times) == [64]
    tried.clear()
    times = probe.time_speed_batches(cfg, model, 64, 2048, 64, 1, {})
    assert tried == [64, 2048, 1024, 512, 256, 128]
    assert sorted(times) == [64, 128]


def test_the_probe_keeps_the_fixed_memory_of_a_study_of_one_batch_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one batch size the memory line went through the origin: the weights, optimizer
    state and workspaces became per-image memory, shrinking with the image area, and a
    smaller-image trial was under-reserved (0.49 GiB predicted for a 1.41 GiB trial)."""
    import hpsearch.probe as probe

    tried: list[int] = []

    def fake_steps(cfg: object, arch: str, batch: int, size: int, steps: int,
                   device_name: str = "cuda") -> tuple[int, float]:  # fmt: skip
        tried.append(batch)
        return GiB + 4 * MiB * batch, 0.009  # 1 GiB fixed, 4 MiB an image

    monkeypatch.setattr(probe, "train_steps", fake_steps)
    cfg = load_config("tiny", ["search_space.batch_size={type: categorical, choices: [64]}"])
    model, t_small, t_large = probe.probe_memory(cfg, "resnet18", 128, 64, 64, 1, "cpu")
    assert tried == [32, 64]
    assert model.fixed_bytes == GiB and model.per_sample_bytes == 4 * MiB
    assert model.trial_bytes(64, 64) == GiB + 64 * MiB  # a quarter of the pixels
    assert t_small == t_large == 0.009
    tried.clear()  # two batch sizes: those two, as before
    model, *_ = probe.probe_memory(cfg, "resnet18", 128, 32, 128, 1, "cpu")
    assert tried == [32, 128] and model.fixed_bytes == GiB


def test_probe_raises_its_own_errors_at_the_reference_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only running out of memory or workspace is retried with a smaller batch: a bug (here
    a shape error) fails the probe instead of quietly weakening its busy estimate."""
    import hpsearch.probe as probe

    def fake_steps(cfg: object, arch: str, batch: int, size: int, steps: int,
                   device_name: str = "cuda") -> tuple[int, float]:  # fmt: skip
        if batch > 128:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x512 and 256x102)")
        return 0, 0.0091

    monkeypatch.setattr(probe, "train_steps", fake_steps)
    model = MemoryModel("resnet18", 128, GiB, MiB, 0)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        probe.time_speed_batches(load_config("tiny"), model, 64, 1024, 128, 1, {})
    assert probe.is_resource_error(RuntimeError("CUDA error: out of memory"))
    assert probe.is_resource_error(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling ..."))
    assert not probe.is_resource_error(RuntimeError("CUDA error: an illegal memory access"))
    assert not probe.is_resource_error(RuntimeError("cuDNN error: CUDNN_STATUS_BAD_PARAM"))


def test_probe_counts_the_data_a_warm_worker_keeps_on_the_device(
    flowers_root: Path, tmp_path: Path
) -> None:
    """What the probe reserves for a worker's data equals what its WarmCache really holds
    after trials at every image size the study searches: each size's uint8 cache of every
    split (no cache_size: 8/7 of the image size) and the resized eval copies."""
    cfg = load_config(
        "tiny",
        data_dir=str(flowers_root),
        overrides=[
            "dataset.cache_size=null",
            "dataset.train_limit=128",
            "dataset.eval_limit=64",
            "budget.max_epochs=1",
            "search_space.image_size={type: categorical, choices: [24, 32]}",
        ],
    )
    warm = WarmCache()
    for size in (24, 32):
        options = TrainOptions(device="cpu", workdir=tmp_path, warm=warm)
        assert train(cfg, {"image_size": size, "batch_size": 32}, options=options).epochs_run == 1
    kept = 0
    for value in warm.data.values():
        for tensor in value if isinstance(value, tuple) else (value,):
            kept += tensor.numel() * tensor.element_size()
    assert data_bytes(cfg) == kept
    assert kept == (128 + 64) * (3 * 27 * 27 + 3 * 37 * 37 + 2 * 8) + 64 * 3 * (24 * 24 + 32 * 32)
    plan = plan_from_probe(["0"], 10 * GiB, [MemoryModel("resnet18", 32, GiB, 0, 0)], GiB,
                           busy=1.0, max_per_gpu=4, data_bytes=GiB)  # fmt: skip
    assert plan.trial_bytes("resnet18", 1, 32) == 2 * GiB
    assert plan.workers_per_gpu == 1  # busy alone: packing more would only time-slice


def test_warm_data_bytes_counts_the_largest_entries_the_cache_can_hold() -> None:
    """At most max_entries stay in a worker's WarmCache, plus the one being made; a stored
    size on the streaming path keeps nothing on the device; a size range counts each size."""
    items = {"train": 100, "val": 50}
    one = warm_data_bytes(items, 40, [32], max_entries=8)
    assert one == 150 * (3 * 40 * 40 + 8) + 50 * 3 * 32 * 32
    sizes = [16, 24, 32, 40, 48, 56]  # no cache_size: 2 caches and 1 eval copy per size
    every = sorted(
        [n * (3 * round(r * 8 / 7) ** 2 + 8) for r in sizes for n in (100, 50)]
        + [50 * 3 * r * r for r in sizes],
        reverse=True,
    )
    assert warm_data_bytes(items, None, sizes, max_entries=4) == sum(every[:5])
    streamed = warm_data_bytes(items, None, [32, 48], 8, fast=lambda stored: stored < 50)
    assert streamed == 150 * (3 * 37 * 37 + 8) + 50 * 3 * 32 * 32  # 48 px: stored at 55
    # Evaluated at 1.25x the trained size (trainer.eval_scale): its copies are that size.
    scaled = warm_data_bytes(items, 40, [32], max_entries=8, eval_scale=1.25)
    assert scaled == 150 * (3 * 40 * 40 + 8) + 50 * 3 * 40 * 40
    cfg = load_config(
        "tiny", overrides=["search_space.image_size={type: int, low: 24, high: 32, step: 4}"]
    )
    assert image_sizes(cfg) == [24, 28, 32]
    assert image_sizes(load_config("tiny")) == [32]  # not searched: the dataset's


def test_probe_without_a_gpu_fails_in_one_line(subprocess_env: dict[str, str]) -> None:
    env = dict(subprocess_env, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "hpsearch.probe", "--study", "tiny"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert (
        proc.stderr.strip() == "probe: --workers auto: the probe needs a CUDA GPU; none is visible"
    )


def test_ledger_reserves_releases_and_forgets_dead_workers(tmp_path: Path) -> None:
    ledger = GpuLedger(tmp_path, "0", total_bytes=10 * GiB)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert ledger.try_reserve(6 * GiB, pid=sleeper.pid)
        assert not ledger.try_reserve(4 * GiB)  # 6 + 4 > 9 (90% of 10)
        assert ledger.try_reserve(3 * GiB)
        assert ledger.reserved() == {sleeper.pid: 6 * GiB, os.getpid(): 3 * GiB}
        ledger.release()
    finally:
        sleeper.kill()
        sleeper.wait()
    # the dead worker's reservation is gone: a large trial fits again
    assert ledger.try_reserve(8 * GiB)
    ledger.release()
    assert ledger.reserved() == {}


def test_a_reused_pid_does_not_hold_a_dead_workers_reservation(tmp_path: Path) -> None:
    """The ledger outlives a crash or a reboot, after which a reservation's PID may be a new,
    unrelated process: the process's start time tells them apart."""
    ledger = GpuLedger(tmp_path, "0", total_bytes=10 * GiB)
    me, start = os.getpid(), process_start(os.getpid())
    assert start is not None
    assert ledger.try_reserve(6 * GiB, pid=me)
    assert json.loads(ledger.path.read_text()) == {str(me): [6 * GiB, start]}
    # The same PID, started at another time: a dead worker's entry, dropped.
    ledger.path.write_text(json.dumps({str(me): [6 * GiB, start - 1]}))
    assert ledger.reserved() == {}
    # An older version's bare entry: kept while the PID lives, as before.
    ledger.path.write_text(json.dumps({str(me): 6 * GiB}))
    assert ledger.reserved() == {me: 6 * GiB}
    assert not ledger.try_reserve(4 * GiB, pid=os.getppid())


def test_an_exited_unreaped_worker_holds_no_reservation(tmp_path: Path) -> None:
    """A worker that exited but was not reaped yet (a zombie: its parent has not waited for
    it) kept its reservation, and its first place in line, until reaped."""
    ledger = GpuLedger(tmp_path, "0", total_bytes=10 * GiB)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert ledger.try_reserve(8 * GiB, pid=child.pid)
        assert not ledger.try_reserve(4 * GiB)
        child.kill()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert ledger.try_reserve(4 * GiB)  # the zombie's 8 GiB are free
        assert child.pid not in ledger.reserved()
    finally:
        child.kill()
        child.wait()


def test_a_mig_id_with_slashes_names_one_ledger_file(tmp_path: Path) -> None:
    mig = "MIG-GPU-5d8b7b7e-6e4c-4d8b-9b0e-1b2c3d4e5f60/1/0"  # the older MIG form
    ledger = GpuLedger(tmp_path, mig, total_bytes=10 * GiB)
    assert ledger.try_reserve(GiB)  # was ValueError: the path named missing folders
    assert ledger.path.parent == tmp_path / "gpu" and "/" not in ledger.path.name
    assert GpuLedger(tmp_path, mig, 10 * GiB).reserved() == {os.getpid(): GiB}


def test_reservation_waits_for_room_then_gives_up(tmp_path: Path) -> None:
    ledger = GpuLedger(tmp_path, "0", total_bytes=10 * GiB)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert ledger.try_reserve(8 * GiB, pid=sleeper.pid)
        waiting = ledger.reservation(4 * GiB, poll_s=0.05, max_wait_s=0.3)
        # handed back to run later (the worker re-queues it), not a failed trial
        with pytest.raises(AdmissionStopped, match=r"waited \d+ s for room"), waiting:
            pass
        assert ledger.waiting() == {}  # its place in line is left
        threading.Timer(0.5, lambda: ledger.release(pid=sleeper.pid)).start()
        with ledger.reservation(4 * GiB, poll_s=0.05) as waited:
            assert waited >= 0.4
            assert ledger.reserved()[os.getpid()] == 4 * GiB
        assert os.getpid() not in ledger.reserved()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_trials_waiting_for_gpu_memory_are_admitted_in_the_order_they_came(
    tmp_path: Path,
) -> None:
    """A large trial waiting for room is not passed by small ones that keep fitting beside
    the trials running: it waited out its limit and failed, and the sampler learned that
    large values fail. A waiter that dies leaves the line."""
    ledger = GpuLedger(tmp_path, "0", total_bytes=10 * GiB)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    running, large = subprocess.Popen(sleep), subprocess.Popen(sleep)
    try:
        assert ledger.try_reserve(8 * GiB, pid=running.pid)
        assert not ledger.try_reserve(4 * GiB, pid=large.pid, since=100.0)  # in line
        assert ledger.waiting() == {large.pid: 100.0}
        assert not ledger.try_reserve(1 * GiB)  # fits, but the large trial came first
        assert not ledger.try_reserve(1 * GiB, since=200.0)
        ledger.release(pid=running.pid)
        assert not ledger.try_reserve(1 * GiB, since=200.0)  # still behind it
        assert ledger.try_reserve(4 * GiB, pid=large.pid, since=100.0)
        assert ledger.try_reserve(1 * GiB, since=200.0)  # now beside it
        assert ledger.waiting() == {}
        ledger.release()
        assert not ledger.try_reserve(6 * GiB, since=300.0)  # 4 + 6 > 9: in line
        ledger.release(pid=large.pid)
        assert not ledger.try_reserve(1 * GiB, pid=running.pid)  # this one waits first
        ledger.leave_line()  # it gave up
        assert ledger.try_reserve(1 * GiB, pid=running.pid)
        assert not ledger.try_reserve(9 * GiB, pid=large.pid, since=400.0)
        large.kill()
        large.wait()
        assert ledger.try_reserve(1 * GiB)  # the dead waiter's place is gone
    finally:
        for proc in (running, large):
            proc.kill()
            proc.wait()


def test_first_in_line() -> None:
    assert first_in_line(5, 10.0, {})
    assert first_in_line(5, 10.0, {5: 10.0, 7: 11.0})
    assert not first_in_line(5, 10.0, {3: 9.0})
    assert first_in_line(3, 10.0, {5: 10.0}) and not first_in_line(5, 10.0, {3: 10.0})  # PIDs
    assert not first_in_line(5, None, {9: 1e12})  # one look waits behind every trial in line


def _on_first_refusal(
    monkeypatch: pytest.MonkeyPatch, action: Callable[[], None], after_s: float
) -> None:
    """Run `action` `after_s` seconds after a ledger first refuses a reservation."""
    real = GpuLedger.try_reserve
    armed: list[threading.Timer] = []

    def spy(self: GpuLedger, *args: Any, **kwargs: Any) -> bool:
        ok = real(self, *args, **kwargs)
        if not ok and not armed:
            armed.append(threading.Timer(after_s, action))
            armed[0].start()
        return ok

    monkeypatch.setattr(GpuLedger, "try_reserve", spy)


def test_packed_worker_waits_for_gpu_memory_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker of an auto plan holds its trial until the trials already on its GPU leave
    room; the wait is recorded in the trial's timings, and the reservation is freed."""
    import json

    cfg = load_config("tiny", overrides=["budget.n_trials=1", "budget.max_epochs=1"])
    models = [MemoryModel("resnet18", 32, 2 * GiB, 0, 0)]
    plan = plan_from_probe(["0"], 10 * GiB, models, 2 * GiB, busy=0.2, max_per_gpu=4)
    plan_file = tmp_path / "packing.json"
    plan_file.write_text(plan.to_json())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "0")
    ledger = GpuLedger(tmp_path, "0", plan.total_bytes)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert ledger.try_reserve(8 * GiB, pid=other.pid)  # another trial fills the GPU
        # The room frees 1.5 s after the worker was first refused (not after it started:
        # a loaded machine may take longer than that to get there).
        _on_first_refusal(monkeypatch, lambda: ledger.release(pid=other.pid), 1.5)
        spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
        opts = WorkerOptions(
            workdir=tmp_path, worker_id="w0", device="auto", packing=plan_file,
            train_fn="dummy_trainer:train",
        )  # fmt: skip
        t0 = time.monotonic()
        summary = run_worker(cfg, spec, opts)
        assert summary.outcomes == {"finished": 1}
        assert time.monotonic() - t0 >= 1.4
    finally:
        other.kill()
        other.wait()
    timing = json.loads((tmp_path / "timings" / "w0.jsonl").read_text().splitlines()[0])
    assert timing["admission_wait_s"] >= 1.0
    assert ledger.reserved() == {}


def test_launch_workers_auto_without_a_gpu_runs_one(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    from cli_util import DUMMY, hpsearch

    env = dict(subprocess_env, CUDA_VISIBLE_DEVICES="")
    r = hpsearch(
        ["launch", "--study", "tiny", "--workers", "auto", "--trials", "2", "--no-tracking",
         "--workdir", str(tmp_path / "w"), "--train-fn", DUMMY, "--set", "budget.max_epochs=1"],
        env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--workers auto: no GPU visible; running 1 worker" in r.stdout
    assert "2 trials, 1 worker," in r.stdout
    bad = hpsearch(["launch", "--study", "tiny", "--workers", "two"], env)
    assert bad.returncode != 0
    assert "'two': expected a whole number >= 1 or 'auto'" in bad.stderr


def test_stop_while_waiting_for_gpu_memory_requeues_the_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker told to stop while its trial waits for room leaves the trial queued to run
    again, not failed as an error."""
    from optuna.trial import TrialState

    cfg = load_config("tiny", overrides=["budget.n_trials=1", "budget.max_epochs=1"])
    models = [MemoryModel("resnet18", 32, 2 * GiB, 0, 0)]
    plan = plan_from_probe(["0"], 10 * GiB, models, 2 * GiB, busy=0.2, max_per_gpu=4)
    plan_file = tmp_path / "packing.json"
    plan_file.write_text(plan.to_json())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    ledger = GpuLedger(tmp_path, "0", plan.total_bytes)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop = threading.Event()
    try:
        assert ledger.try_reserve(9 * GiB, pid=other.pid)  # the GPU stays full
        _on_first_refusal(monkeypatch, stop.set, 1.0)  # told to stop while it waits
        spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
        opts = WorkerOptions(
            workdir=tmp_path, worker_id="w0", device="auto", packing=plan_file,
            train_fn="dummy_trainer:train",
        )  # fmt: skip
        summary = run_worker(cfg, spec, opts, stop=stop)
    finally:
        other.kill()
        other.wait()
    assert summary.outcomes == {"interrupted": 1}
    import hpsearch as hps

    states = [t.state for t in hps.load_study("tiny", workdir=tmp_path).get_trials()]
    assert states == [TrialState.FAIL, TrialState.WAITING]


def test_a_ledger_that_cannot_be_written_after_training_does_not_fail_the_trial(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Releasing the reservation writes the ledger; a full disk there (checkpoints fill it)
    raised out of the finished training and failed a completed trial."""
    ledger = GpuLedger(tmp_path, "0", total_bytes=10 * GiB)
    trained = []
    with ledger.reservation(1 * GiB):
        trained.append(True)
        ledger.path.with_suffix(".tmp").mkdir()  # its write now fails as a full disk would
    assert trained
    assert "could not release the GPU memory reservation" in caplog.text


def test_a_trials_worker_is_alive_only_as_this_host_can_tell() -> None:
    """`status`, a launch's orphan check and the end of a dead worker's MLflow run all ask
    this: a live process under the trial's PID that started later is another one."""
    import socket

    from hpsearch.packing import process_start
    from hpsearch.worker import worker_alive

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here, me, started = socket.gethostname(), os.getpid(), process_start(os.getpid())
    assert started is not None
    assert worker_alive({"host": here, "pid": me, "pid_start": started}) is True
    assert worker_alive({"host": here, "pid": me}) is True  # (an older version's trial)
    assert worker_alive({"host": here, "pid": me, "pid_start": started + 1}) is False
    assert worker_alive({"host": here, "pid": gone.pid}) is False
    assert worker_alive({"host": "elsewhere", "pid": gone.pid}) is None
    assert worker_alive({"host": here}) is None  # no worker named itself on it yet
