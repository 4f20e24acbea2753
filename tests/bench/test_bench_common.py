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


class FakeProc:
    """A /proc of made-up processes: stat (ppid, start, CPU ticks) and cmdline."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, pid: int, ppid: int, cmd: str, ticks: int = 0, start: int = 1000) -> None:
        folder = self.root / str(pid)
        folder.mkdir(parents=True, exist_ok=True)
        # fields after "pid (comm) ": state ppid ... utime(12th) stime(13th) ... starttime(20th)
        rest = ["S", str(ppid)] + ["0"] * 9 + [str(ticks), "0"] + ["0"] * 6 + [str(start)]
        (folder / "stat").write_text(f"{pid} (x y) " + " ".join(rest) + " 0 0\n")
        (folder / "cmdline").write_bytes(cmd.replace(" ", "\0").encode())


def test_own_processes_are_descendants_and_the_databases_backends(
    common: ModuleType, tmp_path: Path
) -> None:
    """Only the bench's processes count: before, every process on the machine was given a role
    by its command line, so a CI's worker showed as the plain side's "worker"."""
    fake = FakeProc(tmp_path)
    fake.add(100, 1, "python bench/overhead.py")  # the bench
    fake.add(101, 100, "python -m hpsearch.cli launch --study tiny")
    fake.add(102, 101, "python -m hpsearch.cli worker --study tiny")
    fake.add(103, 100, "python -m mlflow server --port 5001")
    fake.add(200, 1, "python -m hpsearch.cli worker --study ci")  # someone else's
    fake.add(201, 1, "python -m mlflow server --port 5002")
    fake.add(50, 1, "/usr/lib/postgresql/15/bin/postgres -D /x")
    fake.add(300, 50, "postgres: postgres hpsearch_bench_overhead_9_plain0 127.0.0.1(4) idle")
    fake.add(301, 50, "postgres: 15/main: postgres hpsearch_bench_overhead_9_plain0 [local] idle")
    fake.add(302, 50, "postgres: postgres ci_db 127.0.0.1(5) idle")
    fake.add(303, 50, "postgres: 15/main: checkpointer")
    table = common.process_table(tmp_path)
    assert set(table) == {100, 101, 102, 103, 200, 201, 50, 300, 301, 302, 303}
    assert table[102].ppid == 101 and table[102].cmd.startswith("python -m hpsearch.cli worker")
    mine = common.own_processes(table, [100], ["hpsearch_bench_overhead_9_plain0"])
    assert mine == {101, 102, 103, 300, 301}
    assert common.database_of("postgresql://postgres@127.0.0.1:5432/abc") == "abc"
    assert common.database_of("postgresql://postgres@127.0.0.1:5432") is None


def test_cpu_sampler_leaves_other_processes_out(common: ModuleType, tmp_path: Path) -> None:
    """The plain side of overhead.py starts no launcher or worker: a launcher and a worker of
    another job on the machine burning CPU meanwhile must not show in its rows."""
    fake = FakeProc(tmp_path)
    tck = common._CLK_TCK
    fake.add(100, 1, "python bench/overhead.py")
    fake.add(101, 100, "python bench/overhead.py --child spec.json", ticks=0)
    fake.add(200, 1, "python -m hpsearch.cli launch --study ci", ticks=5 * tck)
    fake.add(201, 200, "python -m hpsearch.cli worker --study ci", ticks=5 * tck)
    fake.add(300, 50, "postgres: postgres bench_db 127.0.0.1(4) idle", ticks=tck)
    fake.add(301, 50, "postgres: postgres ci_db 127.0.0.1(5) idle", ticks=tck)
    sampler = common.CpuSampler(
        interval_s=3600, databases=["bench_db"], proc=tmp_path, root=100
    ).start()
    fake.add(101, 100, "python bench/overhead.py --child spec.json", ticks=3 * tck)
    fake.add(200, 1, "python -m hpsearch.cli launch --study ci", ticks=25 * tck)
    fake.add(201, 200, "python -m hpsearch.cli worker --study ci", ticks=150 * tck)
    fake.add(300, 50, "postgres: postgres bench_db 127.0.0.1(4) idle", ticks=2 * tck)
    fake.add(301, 50, "postgres: postgres ci_db 127.0.0.1(5) idle", ticks=9 * tck)
    assert sampler.stop() == {"plain": 3.0, "postgres": 1.0}
