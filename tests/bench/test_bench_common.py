"""The measuring pieces the benchmarks share (`bench/common.py`): a figure in
docs/performance.md is only as right as these."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


@pytest.fixture(scope="module")
def common() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hpsearch_bench_common", BENCH / "common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_process_roles(common: ModuleType) -> None:
    roles = {
        "postgres: 15/main: postgres test 127.0.0.1(5432) idle": "postgres",
        "python -m mlflow server --host 127.0.0.1 --port 5001": "mlflow-server",
        "python -m hpsearch.cli launch --study tiny": "launcher",
        "python -m hpsearch.cli worker --study tiny --worker-id w0": "worker",
        "python -c from multiprocessing.spawn import spawn_main; spawn_main()": "helper",
        "python bench/overhead.py --child plain": "plain",
        "bash": "other",
    }
    assert {cmd: common.classify(cmd) for cmd in roles} == roles


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_cpu_sampler_counts_a_child_by_role(common: ModuleType) -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    sampler = common.CpuSampler(interval_s=0.05).start()
    # "--child" makes it the plain loop's role; it exits before the sampler stops.
    subprocess.run([sys.executable, "-c", burn, "--child"], check=True)
    time.sleep(0.1)
    totals = sampler.stop()
    # Its 0.6 s of CPU and its start-up, less what it burns after the last sample (50 ms,
    # more when a loaded machine starves the sampler).
    assert 0.45 <= totals.get("plain", 0.0) <= 1.5


def test_gpu_watch_mean_between(common: ModuleType) -> None:
    watch = common.GpuWatch("cpu", None)
    t0 = dt.datetime(2026, 11, 30, 12, 0, 0)
    watch.series = [(t0 + dt.timedelta(seconds=s), u) for s, u in [(0, 10), (1, 50), (2, 90)]]
    assert watch.mean_between(t0 + dt.timedelta(seconds=1), t0 + dt.timedelta(seconds=2)) == 70
    assert watch.mean_between(t0, t0 + dt.timedelta(seconds=5)) == 50
    assert watch.mean_between(t0 + dt.timedelta(seconds=3), t0 + dt.timedelta(seconds=4)) is None
    assert watch.mean_between(None, t0) is None
    watch._record({"system/gpu_utilization": 42.0, "system/gpu_memory_used_mb": 1.0})
    watch._record({"system/gpu_memory_used_mb": 1.0})  # no utilization: not a sample
    assert [u for _, u in watch.series[3:]] == [42.0]


def test_gpu_watch_samples_the_masked_gpu(
    common: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--gpu 0` under CUDA_VISIBLE_DEVICES=2 is the machine's GPU 2, the one the launch's
    worker trains on (before, the watch sampled NVML's device 0: another GPU)."""
    import hpsearch.tracking.gpu as gpu_mod

    asked: list[str | None] = []

    class FakeSampler:
        def __init__(self, sink: object, interval_s: float, visible_devices: str | None) -> None:
            asked.append(visible_devices)

        def start(self) -> bool:
            return False  # no NVML: the watch reports n/a

    monkeypatch.setattr(gpu_mod, "GpuSampler", FakeSampler)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with common.GpuWatch("cuda", "0"):
        pass
    with common.GpuWatch("cuda", "1"):
        pass
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with common.GpuWatch("cuda", None):
        pass
    assert asked == ["2", "3", "0"]


def test_the_warm_up_covers_every_image_size_the_study_searches(common: ModuleType) -> None:
    """Without dataset.cache_size each image_size choice reads its own cache (8/7 of it):
    warming only the default's left the others to decode inside the timed budget."""
    from hpsearch.config import load_config

    study = REPO / "studies" / "flowers102.yaml"
    cfg = load_config(study, ["dataset.cache_size=null"], data_dir="unused")
    assert common.cache_sizes(cfg) == [146, 165]  # image_size choices 128 and 144
    assert common.cache_sizes(load_config(study, [], data_dir="unused")) == [144]


def test_trial_timings_means(common: ModuleType, tmp_path: Path) -> None:
    folder = tmp_path / "timings"
    folder.mkdir()
    rows = [
        {"ask_ms": 10.0, "epochs_s": 2.0, "finish_s": 0.5, "trial_s": 3.0},
        {"ask_ms": 20.0, "epochs_s": 4.0, "finish_s": None, "trial_s": 5.0},
    ]
    (folder / "w0.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{torn")
    out = common.trial_timings(tmp_path)
    assert out == {
        "trials": 2.0,
        "ask_ms_mean": 15.0,
        "epochs_s_mean": 3.0,
        "finish_s_mean": 0.5,  # a missing figure is left out, not counted as 0
        "trial_s_mean": 4.0,
    }


def test_an_interrupted_launch_is_stopped_and_returned_when_asked(
    common: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM to the bench (its time limit) stops the launch and its workers; with
    keep_on_interrupt the run comes back marked, so bench/study.py still writes what the
    study finished instead of nothing."""
    import os
    import signal
    import threading

    tests = Path(__file__).resolve().parents[1]
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "1")
    work = tmp_path / "w"
    args = common.launch_args(
        "tiny", ["budget.max_epochs=50"], data_dir=str(tmp_path), workdir=work, device="cpu",
        gpu=None, workers=1, trials=5,
    )  # fmt: skip
    args += ["--train-fn", "dummy_trainer:train"]
    log = work / "launch.log"

    def stop_when_training() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if log.is_file() and "running 1" in log.read_text(errors="replace"):
                break
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_training, daemon=True).start()
    run = common.run_launch(args, log, hard_stop_s=120, keep_on_interrupt=True)
    assert run.interrupted and run.returncode is not None and run.wall_s < 60
    assert run.stops and "SIGTERM" in run.stops[0]
    workers = subprocess.run(
        ["pgrep", "-f", f"hpsearch.cli worker.*{work}"], capture_output=True, text=True
    )
    assert workers.stdout.strip() == ""  # none outlived the launch
