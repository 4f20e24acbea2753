"""GPU telemetry with a FAKE of the few NVML functions the sampler uses."""

from __future__ import annotations

import os
import time
import types
from collections.abc import Mapping
from typing import Any

import pytest
from hpsearch.config import load_config
from hpsearch.tracking import gpu
from hpsearch.tracking.gpu import (
    GpuSampler,
    cuda_order_differs,
    device_labels,
    integrate_power,
    is_input_bound,
    refs_by_uuid,
    resolve_visible_devices,
    sampler_for_tracker,
    share_scaled_utilization,
)
from tracking_helpers import MIG, PID, UUIDS, FakeGpu, FakeNVML


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    gpu.reset_warnings()


def fleet(n: int = 4) -> list[FakeGpu]:
    return [FakeGpu(uuid=u) for u in UUIDS[:n]]


# --------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("2", [2]),
        ("3,1", [3, 1]),
        (" 1 , 2 ", [1, 2]),
        ("0,-1,1", [0]),  # CUDA stops at the first invalid entry
        ("-1", []),
        ("7", []),  # out of range
        ("1,1", [1]),  # repeated
        (UUIDS[2], [2]),
        (UUIDS[3][:10], [3]),  # unique prefix
        ("GPU-", []),  # ambiguous prefix
        (f"{UUIDS[1]},0", [1, 0]),
        (MIG, [MIG]),
        ("GPU-ffffffff", []),  # unknown uuid
        ("abc,0", []),
    ],
)
def test_resolve_visible_devices(value: str | None, expected: list[int | str]) -> None:
    assert resolve_visible_devices(value, UUIDS) == expected


@pytest.mark.parametrize(
    ("value", "order", "n_gpus", "differs"),
    [
        ("1", None, 4, True),  # unset: CUDA's FASTEST_FIRST
        ("1", "FASTEST_FIRST", 4, True),
        ("1", "PCI_BUS_ID", 4, False),
        ("1", " pci_bus_id ", 4, False),
        ("0", None, 1, False),  # one GPU: one order
        (None, None, 4, False),  # every GPU: the same set, labelled by NVML
        (UUIDS[1], None, 4, False),  # a UUID names one GPU to both
        (f"{UUIDS[1]},0", None, 4, True),
    ],
)
def test_cuda_order_differs(
    value: str | None, order: str | None, n_gpus: int, differs: bool
) -> None:
    assert cuda_order_differs(value, order, n_gpus) is differs


def torch_style(uuid: str) -> str:
    """How torch prints a device's UUID: no ``GPU-`` prefix."""
    return uuid.removeprefix("GPU-")


def test_refs_by_uuid_maps_cudas_list_to_nvml_indices() -> None:
    assert refs_by_uuid([torch_style(UUIDS[2]), UUIDS[0].upper()], UUIDS) == [2, 0]
    # A MIG instance: CUDA gives it the UUID NVML knows it by, as resolve_visible_devices.
    assert refs_by_uuid([torch_style(UUIDS[3]), MIG.removeprefix("MIG-"), UUIDS[1]], UUIDS) == [
        3,
        MIG,
        1,
    ]
    assert refs_by_uuid([UUIDS[1], "not-a-uuid", UUIDS[2]], UUIDS) == [1]  # stops there
    assert refs_by_uuid([UUIDS[1], torch_style(UUIDS[1])], UUIDS) == [1]  # repeated
    assert refs_by_uuid([], UUIDS) == []


def test_an_index_under_cudas_fastest_first_order_is_found_by_uuid(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under FASTEST_FIRST, CUDA's GPU 0 may be NVML's GPU 2: the sampler asks CUDA which GPU
    it is and samples that one."""
    asked: list[int] = []

    def cuda_uuids() -> list[str]:
        asked.append(1)
        return [torch_style(UUIDS[2])]

    nvml = FakeNVML(fleet())
    s = GpuSampler(
        None, visible_devices="0", device_order="FASTEST_FIRST", nvml=nvml, cuda_uuids=cuda_uuids
    )
    assert s.open() and s.device_refs == [2] and asked == [1]
    s.sample_once()
    assert nvml.queried == {2}
    s.stop()

    # NVML's own order: no question to CUDA.
    s = GpuSampler(
        None, visible_devices="0", device_order="PCI_BUS_ID", nvml=FakeNVML(fleet()),
        cuda_uuids=cuda_uuids,
    )  # fmt: skip
    assert s.open() and s.device_refs == [0] and asked == [1]
    s.stop()

    # CUDA's list unknown (torch not imported, no CUDA): NVML's order, with a warning.
    with caplog.at_level("WARNING"):
        s = GpuSampler(
            None, visible_devices="0", device_order="FASTEST_FIRST", nvml=FakeNVML(fleet()),
            cuda_uuids=lambda: None,
        )  # fmt: skip
        assert s.open() and s.device_refs == [0]
        s.stop()
    assert "CUDA_DEVICE_ORDER=FASTEST_FIRST may number GPUs unlike NVML" in caplog.text

    # CUDA lists a device NVML cannot be matched with: NVML's order too, not no telemetry.
    gpu.reset_warnings()
    caplog.clear()
    with caplog.at_level("WARNING"):
        s = GpuSampler(
            None, visible_devices="1", device_order="FASTEST_FIRST", nvml=FakeNVML(fleet()),
            cuda_uuids=lambda: ["garbled"],
        )  # fmt: skip
        assert s.open() and s.device_refs == [1]
        s.stop()
    assert "(garbled) are not known to NVML" in caplog.text


def test_the_environments_order_applies_to_the_environments_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    cuda = [torch_style(UUIDS[3])]
    s = GpuSampler(None, nvml=FakeNVML(fleet()), cuda_uuids=lambda: cuda)
    assert s.open() and s.device_refs == [3]
    s.stop()
    # No order in the environment is CUDA's default, FASTEST_FIRST: found by UUID too.
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    s = GpuSampler(None, nvml=FakeNVML(fleet()), cuda_uuids=lambda: cuda)
    assert s.open() and s.device_refs == [3]
    s.stop()
    # An explicit value is NVML's numbering unless told otherwise (bench/: `nvidia-smi` ids).
    s = GpuSampler(None, visible_devices="1", nvml=FakeNVML(fleet()), cuda_uuids=lambda: cuda)
    assert s.open() and s.device_refs == [1]
    s.stop()


def test_device_labels() -> None:
    assert device_labels([3]) == [""]
    assert device_labels([]) == []
    assert device_labels([2, 0, MIG]) == ["_2", "_0", "_mig0"]


def test_is_input_bound() -> None:
    samples = [(float(t), 30.0) for t in range(0, 61, 5)]
    assert is_input_bound(samples, 60.0, 60.0, 50.0, history_start=0.0) == (True, 30.0)
    assert is_input_bound(samples, 59.0, 60.0, 50.0, history_start=0.0) == (False, None)
    busy = [(t, 80.0) for t, _ in samples]
    assert is_input_bound(busy, 60.0, 60.0, 50.0, history_start=0.0) == (False, 80.0)
    assert is_input_bound([], 100.0, 60.0, 50.0, history_start=0.0) == (False, None)


def test_integrate_power() -> None:
    assert integrate_power([(0.0, 100.0), (10.0, 200.0)]) == pytest.approx(1500.0)
    assert integrate_power([(0.0, 100.0)]) == 0.0


# --------------------------------------------------------------------------- sampler


def test_samples_only_the_visible_gpus_and_summarises() -> None:
    nvml = FakeNVML(fleet())
    nvml.gpus[2].proc_util = {PID: 70.0, 999: 20.0}
    nvml.gpus[2].proc_mem = {PID: 512 * 1024 * 1024, 999: 1}
    clock = Clock()
    sent: list[Mapping[str, float]] = []
    s = GpuSampler(sent.append, visible_devices="2", nvml=nvml, pid=PID, clock=clock)
    assert s.open() and s.device_refs == [2]
    for i in range(3):
        nvml.gpus[2].mem_used = (1 + i) * 1024**3
        nvml.gpus[2].energy_mj = 1_000_000.0 + 5_000.0 * (i + 1)
        s.sample_once()
        clock.t += 5
    assert nvml.queried == {2}
    assert sent[0] == {
        "system/gpu_utilization": 90.0,
        "system/gpu_process_utilization": 70.0,
        "system/gpu_memory_mib": 1024.0,
        "system/gpu_process_memory_mib": 512.0,
        "system/gpu_power_w": 250.0,
        "system/gpu_temperature_c": 60.0,
        "system/gpu_sm_clock_mhz": 1980.0,
    }
    summary = s.stop()
    assert summary == {
        "system/gpu_utilization_mean": 90.0,
        "system/gpu_process_utilization_mean": 70.0,
        "system/gpu_memory_peak_mib": 3072.0,
        "system/gpu_process_memory_peak_mib": 512.0,
        "system/gpu_energy_j": 15.0,  # NVML counter: 15000 mJ
    }
    assert nvml.shutdowns == 1


def test_several_gpus_get_suffixes_and_energy_falls_back_to_power() -> None:
    nvml = FakeNVML(fleet())
    for g in nvml.gpus:
        g.energy_mj = None  # counter not supported
        g.proc_util = None  # per-process utilization not supported
    nvml.gpus[3].util = 50.0
    clock = Clock()
    sent: list[Mapping[str, float]] = []
    s = GpuSampler(sent.append, visible_devices="3,1", nvml=nvml, pid=PID, clock=clock)
    assert s.open()
    s.sample_once()
    clock.t += 10
    nvml.gpus[3].power_mw = 350_000
    s.sample_once()
    assert {"system/gpu_utilization_3", "system/gpu_utilization_1"} <= set(sent[0])
    assert not any("process_utilization" in k for k in sent[0])
    summary = s.summary()
    assert summary["system/gpu_utilization_mean_3"] == 50.0
    assert summary["system/gpu_utilization_mean_1"] == 90.0
    # Unsuffixed: the trial's own GPU (cuda:0 of the mask "3,1": GPU 3), not a mean or
    # sum with one it does not use.
    assert summary["system/gpu_utilization_mean"] == 50.0
    assert summary["system/gpu_energy_j_3"] == pytest.approx(10 * (250 + 350) / 2)
    assert summary["system/gpu_energy_j_1"] == pytest.approx(2500.0)
    assert summary["system/gpu_energy_j"] == pytest.approx(3000.0)
    assert summary["system/gpu_memory_peak_mib"] == summary["system/gpu_memory_peak_mib_3"]
    s.stop()


def test_input_bound_fires_once_and_can_request_stop(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNVML(fleet(1))
    nvml.gpus[0].util = 95.0  # the device is busy ...
    nvml.gpus[0].proc_util = {PID: 20.0}  # ... but not with this worker
    clock = Clock()
    fired: list[float] = []
    s = GpuSampler(
        None,
        visible_devices="0",
        nvml=nvml,
        pid=PID,
        clock=clock,
        window_s=60.0,
        warmup_s=10.0,
        threshold_pct=50.0,
        stop_when_input_bound=True,
        on_input_bound=fired.append,
    )
    assert s.open()
    for _ in range(14):  # 0..65 s: warm-up, then 55 s of history: no decision yet
        s.sample_once()
        clock.t += 5
    assert not s.input_bound and not s.should_stop() and fired == []
    for _ in range(5):
        s.sample_once()
        clock.t += 5
    assert s.input_bound and s.should_stop()
    assert fired == [20.0]
    assert caplog.text.count("looks input-bound") == 1
    assert s.summary()["system/gpu_input_bound_utilization"] == 20.0


@pytest.mark.parametrize(
    ("device", "cuda", "expected"),
    [("cpu", True, None), ("auto", False, None), ("auto", True, 0), ("cuda", True, 0),
     ("cuda:1", True, 1)],
)  # fmt: skip
def test_trial_gpu_index(device: str, cuda: bool, expected: int | None) -> None:
    assert gpu.trial_gpu_index(device, cuda) == expected


def test_the_rule_judges_the_trials_own_gpu_and_a_cpu_trial_samples_none() -> None:
    """A mask of two GPUs, the trial training on the first (cuda:0) at 90%: the mean with
    the other's 0% read 45% and stopped it as input-bound. A --device cpu worker on a GPU
    machine sampled GPU 0 (0% of its own) and was stopped 90 s in."""
    nvml = FakeNVML(fleet(2))
    nvml.gpus[0].proc_util = {PID: 90.0}
    nvml.gpus[1].util, nvml.gpus[1].proc_util = 0.0, {}  # idle
    for trial_device, bound in ((0, False), (1, True)):
        clock = Clock()
        s = GpuSampler(None, visible_devices="0,1", nvml=nvml, pid=PID, clock=clock,
                       warmup_s=0.0, window_s=20.0, stop_when_input_bound=True,
                       trial_device=trial_device)  # fmt: skip
        assert s.open()
        for _ in range(8):
            s.sample_once()
            clock.t += 5
        assert s.should_stop() is bound, trial_device
        s.stop()
    cpu = GpuSampler(None, visible_devices="0,1", nvml=nvml, pid=PID, trial_device=None)
    assert not cpu.open() and cpu.sample_once() == {}


def test_the_rule_waits_out_a_wait_for_gpu_memory() -> None:
    """A packed trial waits for GPU memory with its sampler running: 120 s of 0% before its
    first step flagged it (and stopped it at its first report), unless the rule is paused
    for the wait and starts again, warm-up included, when it trains."""
    flagged = []
    for paused in (False, True):
        nvml = FakeNVML(fleet(1))
        nvml.gpus[0].util, nvml.gpus[0].proc_util = 0.0, {PID: 0.0}
        clock = Clock()
        s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, clock=clock,
                       window_s=60.0, warmup_s=30.0, threshold_pct=50.0)  # fmt: skip
        assert s.open()
        if paused:
            s.pause_rule()
        for _ in range(24):  # 0..115 s waiting: past the warm-up and a whole window
            assert s.sample_once()  # still sampled and logged
            clock.t += 5
        if paused:
            s.restart_warmup()
        nvml.gpus[0].util, nvml.gpus[0].proc_util = 95.0, {PID: 10.0}  # its first steps
        s.sample_once()
        clock.t += 5
        s.sample_once()
        flagged.append(s.input_bound)
    assert flagged == [True, False]


def _idle_for_100_s(**kwargs: Any) -> tuple[FakeNVML, Clock, GpuSampler]:
    """One GPU at 0% for 100 s (20 samples), under a 10 s warm-up and a 60 s window."""
    nvml = FakeNVML(fleet(1))
    nvml.gpus[0].util, nvml.gpus[0].proc_util = 0.0, {PID: 0.0}
    clock = Clock()
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, clock=clock, window_s=60.0,
                   warmup_s=10.0, threshold_pct=50.0, **kwargs)  # fmt: skip
    assert s.open()
    for _ in range(20):
        assert s.sample_once()
        clock.t += 5
    return nvml, clock, s


def test_a_flag_before_training_runs_stops_nothing_and_stopping_follows_the_window() -> None:
    """Set-up and a compiling first epoch leave the GPU idle for minutes: the worker restarts
    the warm-up at the first epoch's end, after which a flag raised before (kept on record,
    as the run's tag is) stops nothing. A trial that was input-bound (a cold first read)
    and runs at speed since is not stopped for it."""
    nvml, clock, s = _idle_for_100_s(stop_when_input_bound=True)  # set-up
    assert s.input_bound and s.should_stop()
    s.restart_warmup()  # the first epoch's end
    assert s.input_bound and not s.should_stop()
    for _ in range(16):  # starved: flagged again, and stopped at the next report
        s.sample_once()
        clock.t += 5
    assert s.input_bound and s.should_stop()
    nvml.gpus[0].util, nvml.gpus[0].proc_util = 95.0, {PID: 90.0}
    for _ in range(13):  # a whole window at speed
        s.sample_once()
        clock.t += 5
    assert s.input_bound and not s.should_stop()  # recorded, no longer stopped


def test_a_trials_sampler_judges_from_its_first_epochs_end_not_its_start() -> None:
    """A worker's trial sampler starts paused (TrackingSession's options): 100 s of set-up
    or compiling at 0% flagged the trial input-bound for good (its run's tag, its Optuna
    attribute), although it ran at speed from its first epoch on."""
    from hpsearch.runs import TrackingSession

    options = TrackingSession._sampler_options(  # type: ignore[arg-type]
        types.SimpleNamespace(cfg=load_config("tiny"), device="cpu")
    )
    assert options["paused"] is True
    _, clock, s = _idle_for_100_s(paused=True)  # set-up, sampled and logged
    assert s.samples_taken == 20 and not s.input_bound
    s.restart_warmup()  # the first epoch's end
    for _ in range(16):  # starved from then on: flagged
        s.sample_once()
        clock.t += 5
    assert s.input_bound


def test_busy_gpu_is_not_input_bound_and_policy_off_never_stops() -> None:
    nvml = FakeNVML(fleet(1))
    clock = Clock()
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, clock=clock, warmup_s=0)
    nvml.gpus[0].proc_util = {PID: 88.0}
    assert s.open()
    for _ in range(30):
        s.sample_once()
        clock.t += 5
    assert not s.input_bound and not s.should_stop()
    nvml.gpus[0].proc_util = {}  # this worker stops using the GPU (no samples)
    for _ in range(30):
        s.sample_once()
        clock.t += 5
    assert s.input_bound and not s.should_stop()  # flagged, but stopping is not requested


def test_pid_never_seen_falls_back_to_device_utilization() -> None:
    # In a container NVML reports host PIDs: this worker's PID is never listed.
    nvml = FakeNVML(fleet(1))
    nvml.gpus[0].util = 85.0
    nvml.gpus[0].proc_util = {99999: 85.0}
    nvml.gpus[0].proc_mem = {99999: 1024**3}
    clock = Clock()
    sent: list[Mapping[str, float]] = []
    s = GpuSampler(sent.append, visible_devices="0", nvml=nvml, pid=PID, clock=clock, warmup_s=0)
    assert s.open()
    for _ in range(20):
        s.sample_once()
        clock.t += 5
    assert not any("process" in k for m in sent for k in m)
    assert not s.input_bound  # device utilization 85 % is used, not a fake 0 %
    summary = s.stop()
    assert "system/gpu_process_utilization_mean" not in summary
    assert summary["system/gpu_utilization_mean"] == 85.0


def test_without_nvml_nothing_is_logged_and_it_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent: list[Mapping[str, float]] = []
    for _ in range(3):
        s = GpuSampler(sent.append, nvml=FakeNVML(fleet(), init_error=True))
        assert s.start() is False and not s.available
        assert s.sample_once() == {}
        assert s.stop() == {}
        assert not s.should_stop()
    assert sent == []
    assert caplog.text.count("NVML is not available") == 1


def test_no_visible_gpu_is_silent_after_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    sent: list[Mapping[str, float]] = []
    for value in ("", "-1"):
        s = GpuSampler(sent.append, visible_devices=value, nvml=FakeNVML(fleet()))
        assert s.start() is False
        assert s.stop() == {}
    assert sent == [] and caplog.text.count("no visible GPU") == 1


def test_real_pynvml_on_this_machine_never_raises() -> None:
    s = GpuSampler(lambda m: None, interval_s=0.05)
    s.start()
    summary = s.stop()
    if not s.available:
        assert summary == {}


def test_env_and_background_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", UUIDS[1])
    nvml = FakeNVML(fleet())
    sent: list[Mapping[str, float]] = []
    s = GpuSampler(sent.append, interval_s=0.01, nvml=nvml, pid=os.getpid())
    with s:
        assert s.device_refs == [1]
        deadline = 200
        while len(sent) < 3 and deadline:
            time.sleep(0.01)
            deadline -= 1
    assert len(sent) >= 3 and nvml.queried == {1}


def test_a_failing_sink_does_not_stop_sampling(caplog: pytest.LogCaptureFixture) -> None:
    def bad_sink(metrics: Mapping[str, float]) -> None:
        raise RuntimeError("sink down")

    s = GpuSampler(bad_sink, visible_devices="0", nvml=FakeNVML(fleet(1)), clock=Clock())
    assert s.open()
    assert s.sample_once() and s.sample_once()
    assert s.samples_taken == 2 and caplog.text.count("sink failed") == 1


class FakeTracker:
    def __init__(self) -> None:
        self.system: list[Mapping[str, float]] = []
        self.tags: dict[str, str] = {}

    def log_system(self, metrics: Mapping[str, float], timestamp_ms: int | None = None) -> None:
        self.system.append(metrics)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.tags.update(tags)


def test_sampler_for_tracker_tags_input_bound() -> None:
    tracker = FakeTracker()
    nvml = FakeNVML(fleet(1))
    nvml.gpus[0].proc_util = {PID: 10.0}
    clock = Clock()
    seen: list[float] = []
    s = sampler_for_tracker(
        tracker,
        visible_devices="0",
        nvml=nvml,
        pid=PID,
        clock=clock,
        warmup_s=0,
        window_s=20,
        on_input_bound=seen.append,
    )
    assert s.open()
    for _ in range(6):
        s.sample_once()
        clock.t += 5
    assert tracker.tags == {
        "hpsearch.input_bound": "true",
        "hpsearch.input_bound_utilization": "10.0",
    }
    assert seen == [10.0] and len(tracker.system) == 6


def test_pid_seen_by_the_memory_query_only_keeps_device_utilization() -> None:
    # Some drivers answer in a container with the container's PID for running processes and
    # the host's for utilization samples: the memory query's sighting must not make the
    # utilization query's silence a 0 % that flags every trial input-bound.
    nvml = FakeNVML(fleet(1))
    nvml.gpus[0].util = 97.0
    nvml.gpus[0].proc_util = {99999: 97.0}  # the host PID of this worker
    nvml.gpus[0].proc_mem = {PID: 2 * 1024**3}
    clock = Clock()
    sent: list[Mapping[str, float]] = []
    s = GpuSampler(
        sent.append,
        visible_devices="0",
        nvml=nvml,
        pid=PID,
        clock=clock,
        warmup_s=0,
        stop_when_input_bound=True,
    )
    assert s.open()
    for _ in range(20):
        s.sample_once()
        clock.t += 5
    assert not s.input_bound and not s.should_stop()
    assert not any("gpu_process_utilization" in k for m in sent for k in m)
    assert sent[-1]["system/gpu_process_memory_mib"] == 2048.0  # its own query saw the PID
    assert s.stop()["system/gpu_utilization_mean"] == 97.0


@pytest.mark.parametrize(
    ("device", "mine", "theirs", "flagged"),
    [(99.0, 24.0, 25.0, False), (99.0, 5.0, 30.0, True), (60.0, 15.0, 15.0, True)],
)
def test_packed_workers_are_judged_by_their_share(
    device: float, mine: float, theirs: float, flagged: bool
) -> None:
    # Four packed processes on a saturated GPU read about 25 % each: that is a full share,
    # not input-bound; one at 5 % beside three busy ones is starved. Four at 15 % on a GPU
    # 60 % busy do not wait for each other: all four are short of input.
    nvml = FakeNVML(fleet(1))
    nvml.gpus[0].util = device
    nvml.gpus[0].proc_util = {PID: mine, **{70000 + k: theirs for k in range(3)}}
    clock = Clock()
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, clock=clock, warmup_s=0)
    assert s.open()
    for _ in range(20):
        s.sample_once()
        clock.t += 5
    assert s.input_bound is flagged
    if flagged:
        scaled = device >= gpu.SATURATED_PCT
        assert s.input_bound_mean == pytest.approx(mine * 4 if scaled else mine)


def test_share_scaled_utilization() -> None:
    assert share_scaled_utilization(24.0, 4) == 96.0
    assert share_scaled_utilization(40.0, 4) == 100.0  # capped
    assert share_scaled_utilization(30.0, 0) == 30.0  # at least this process


def test_without_a_mask_only_cudas_first_gpu_is_sampled(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer uses cuda:0 when CUDA_VISIBLE_DEVICES is unset: the other GPUs of the
    machine are not the trial's, and their idle time must not flag it input-bound."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    nvml = FakeNVML(fleet())
    s = GpuSampler(None, nvml=nvml, pid=PID, cuda_uuids=lambda: [UUIDS[2], UUIDS[0]])
    assert s.open() and s.device_refs == [2]  # CUDA's fastest first: found by its UUID
    s.stop()
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    s = GpuSampler(None, nvml=FakeNVML(fleet()), pid=PID, cuda_uuids=lambda: None)
    assert s.open() and s.device_refs == [0]
    s.stop()
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    s = GpuSampler(None, nvml=FakeNVML(fleet()), pid=PID, cuda_uuids=lambda: None)
    assert s.open() and s.device_refs == [0]
    s.stop()
    assert "NVML's GPU 0 is sampled" in caplog.text
    s = GpuSampler(None, nvml=FakeNVML(fleet()), pid=PID, use_env=False)
    assert s.open() and s.device_refs == [0, 1, 2, 3]  # asked for all of them
    s.stop()
    # A trial on cuda:1 (WorkerOptions.device): CUDA's device 1, judged as the trial's; it
    # sampled device 0 and judged none.
    nvml = FakeNVML(fleet())
    nvml.gpus[0].util, nvml.gpus[0].proc_util = 95.0, {PID: 95.0}
    clock = Clock()
    s = GpuSampler(None, nvml=nvml, pid=PID, clock=clock, warmup_s=0.0, window_s=20.0,
                   cuda_uuids=lambda: [UUIDS[2], UUIDS[0]], trial_device=1)  # fmt: skip
    assert s.open() and s.device_refs == [0]
    for _ in range(8):
        s.sample_once()
        clock.t += 5
    assert not s.input_bound and s.stop()["system/gpu_utilization_mean"] == 95.0


def test_the_first_query_skips_what_nvml_buffered_before_the_trial() -> None:
    """NVML answers a query from timestamp 0 with its whole buffer: the previous trial of
    this worker (the same PID), and processes since gone, which counted as busy sharers."""
    nvml = FakeNVML(fleet(1))
    nvml.gpus[0].buffered = [(PID, 5.0), (70001, 90.0), (70002, 90.0)]
    nvml.gpus[0].proc_util = {PID: 80.0}
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, clock=Clock())
    assert s.open()
    assert s.sample_once()["system/gpu_process_utilization"] == 80.0
    assert s.stop()["system/gpu_process_utilization_mean"] == 80.0


def test_a_failed_process_query_is_not_an_idle_sample() -> None:
    """Only NOT_FOUND means no process ran since the last query; a timeout or a lost GPU
    says nothing, and counted as 0 % it flagged a busy trial."""
    nvml = FakeNVML(fleet(1))
    nvml.gpus[0].util, nvml.gpus[0].proc_util = 95.0, {PID: 90.0}
    clock = Clock()
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, clock=clock, warmup_s=0)
    assert s.open()
    s.sample_once()
    nvml.gpus[0].proc_error = 10  # NVML_ERROR_TIMEOUT
    for _ in range(20):
        s.sample_once()
        clock.t += 5
    assert not s.input_bound
    nvml.gpus[0].proc_error, nvml.gpus[0].proc_util = None, {}  # NOT_FOUND: idle
    for _ in range(20):
        s.sample_once()
        clock.t += 5
    assert s.input_bound


def test_stop_reads_the_energy_to_the_end_and_gives_up_on_a_hanging_nvml() -> None:
    nvml = FakeNVML(fleet(1))
    nvml.gpus[0].proc_util = {PID: 80.0}
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, clock=Clock())
    assert s.open()
    nvml.gpus[0].energy_mj = 1_005_000.0
    s.sample_once()
    nvml.gpus[0].energy_mj = 1_012_000.0  # the last interval, after the last periodic sample
    nvml.gpus[0].proc_util = {}  # training is over: the GPU is idle at the stop
    summary = s.stop()
    assert summary["system/gpu_energy_j"] == 12.0
    assert summary["system/gpu_process_utilization_mean"] == 80.0  # no idle sample added
    nvml = FakeNVML(fleet(1))
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, interval_s=0.05)
    assert s.start()
    time.sleep(0.2)
    nvml.gpus[0].hang_s = 8.0  # the next sample hangs, holding the sampler's lock
    assert nvml.hanging.wait(30)
    t0 = time.monotonic()
    s.pause_rule()  # the training thread's calls do not wait for it
    s.restart_warmup()
    assert time.monotonic() - t0 < 0.5
    assert s.stop() == {}  # no summary, and no wait for NVML
    assert time.monotonic() - t0 < 6.5


def test_a_gpu_this_process_may_not_open_leaves_the_others_sampled() -> None:
    """NVML counts every GPU of the machine, also those a cgroup keeps from this process;
    opening one of them failed, and telemetry went off for the GPU the trial has."""
    nvml = FakeNVML(fleet(2))
    nvml.gpus[0].forbidden = True
    assert gpu.nvml_uuids(nvml) == ["", UUIDS[1]]
    # CUDA numbers only the GPU it may open (its 0, NVML's 1): found by its UUID.
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, clock=Clock(),
                   cuda_uuids=lambda: [UUIDS[1]])  # fmt: skip
    assert s.open() and s.device_refs == [1]
    assert s.sample_once()["system/gpu_utilization"] == 90.0
    s.stop()
    # Without torch's UUIDs no index can be trusted: off, not another GPU's figures.
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, cuda_uuids=lambda: None)
    assert not s.open()
    # A UUID names its GPU however NVML numbers them.
    s = GpuSampler(None, visible_devices=UUIDS[1][:12], nvml=nvml, pid=PID, cuda_uuids=lambda: None)
    assert s.open() and s.device_refs == [1]
    s.stop()


def test_a_pause_right_after_a_restart_holds() -> None:
    """restart_warmup is applied at the next sample: a pause_rule between the two stays."""
    nvml = FakeNVML(fleet(1))
    nvml.gpus[0].util, nvml.gpus[0].proc_util = 0.0, {PID: 0.0}
    clock = Clock()
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, clock=clock, window_s=60.0,
                   warmup_s=10.0, threshold_pct=50.0)  # fmt: skip
    assert s.open()
    s.restart_warmup()
    s.pause_rule()  # waits for GPU memory
    for _ in range(30):  # 150 s idle while it waits
        s.sample_once()
        clock.t += 5
    assert not s.input_bound


def test_one_failed_process_memory_query_turns_nothing_off_and_the_peak_is_kept() -> None:
    """Any error of the per-process memory query (a timeout once) turned it off for the
    trial, and the summary then dropped the peak already measured."""
    nvml = FakeNVML(fleet(1))
    g = nvml.gpus[0]
    g.proc_mem = {PID: 1024 * 1024 * 1024}
    s = GpuSampler(None, visible_devices="0", nvml=nvml, pid=PID, clock=Clock())
    assert s.open()
    s.sample_once()
    g.mem_error = 10  # NVML_ERROR_TIMEOUT
    s.sample_once()
    g.mem_error, g.proc_mem = None, {PID: 2 * 1024 * 1024 * 1024}
    s.sample_once()
    assert s.summary()["system/gpu_process_memory_peak_mib"] == 2048.0
    g.mem_error = 3  # NOT_SUPPORTED: off from here, the peak measured stays
    s.sample_once()
    assert s.summary()["system/gpu_process_memory_peak_mib"] == 2048.0
    s.stop()
