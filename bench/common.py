"""Shared pieces of the launch benchmarks (`packing.py`, `study.py`): the record of the machine
and versions, the study config with the bench's overrides, a pre-built data cache, the real
`hpsearch launch` as a subprocess with a hard stop, and NVML sampling of the GPU it uses.

Not a benchmark itself; imported by its neighbours (`python bench/packing.py` puts `bench/` on
`sys.path`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from hpsearch.config import StudyConfig, load_config
from optuna.exceptions import ExperimentalWarning

# Studies may use experimental Optuna options (flowers102: TPE `group`); the warning is not
# repeated on every config load in the bench's output (the launch logs keep it).
warnings.filterwarnings("ignore", category=ExperimentalWarning)

REPO = Path(__file__).resolve().parents[1]
# Seconds a launch gets after the bench's first SIGTERM (Ctrl-C or the bench's own SIGTERM)
# before the second, which kills its workers: time for a running epoch's checkpoint, the
# workers' exit and the launch's clean-up (its temp folders, e.g. the worker's
# $TMPDIR/hpsearch-artifacts-*). 1 s cut that short and left such folders behind.
STOP_GRACE_S = 8.0
# Variables that would point a launch at the user's own storage, tracking server or work folder.
PRIVATE_ENV = ("HPSEARCH_STORAGE", "MLFLOW_TRACKING_URI", "HPSEARCH_WORKDIR")


class BenchError(Exception):
    """Bad input or a failed run: one line on stderr, exit code 2."""


def run_main(script: str, main: Callable[[], int], stop_on_sigterm: bool = True) -> int:
    """Run a bench's `main` with the benches' handling of bad input and stops:

    - BenchError or an hpsearch error (a bad study, no such dataset, no GPU): one line
      "bench/SCRIPT: error: ..." on stderr, exit code 2, no traceback;
    - Ctrl-C, or SIGTERM (`timeout`) turned into KeyboardInterrupt once (`stop_on_sigterm`),
      so that the `finally` blocks on the way out (a database dropped, a temp folder removed,
      children stopped) run: one line, exit code 130. A second SIGTERM is ignored while that
      clean-up runs; SIGKILL still ends the bench."""
    from hpsearch.errors import HpsearchError

    previous = signal.getsignal(signal.SIGTERM)
    if stop_on_sigterm:
        signal.signal(signal.SIGTERM, _sigterm_once)
    try:
        return main()
    except (BenchError, HpsearchError) as exc:
        print(f"bench/{script}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"bench/{script}: interrupted", file=sys.stderr)
        return 130
    finally:
        if stop_on_sigterm:
            signal.signal(signal.SIGTERM, previous)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (a pydantic or psycopg2 message spans several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


_sigterm_seen = False


def _sigterm_once(signum: int, frame: Any) -> None:
    global _sigterm_seen
    if not _sigterm_seen:
        _sigterm_seen = True
        raise KeyboardInterrupt


def check_output_path(value: str | None, option: str = "--json") -> None:
    """A results file the bench will write at its end: its folder must exist and be
    writable now, not after minutes of work (BenchError otherwise)."""
    if value is None:
        return
    path = Path(value)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise BenchError(f"{option}: {value}: is a folder (give a file name)")
    if not folder.is_dir():
        raise BenchError(f"{option}: {value}: no such folder {str(folder)!r}")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise BenchError(f"{option}: {value}: not writable")


def jsonable(obj: Any) -> Any:
    """NaN and infinities -> null, so that the file is strict JSON (json.dumps writes NaN,
    which strict parsers refuse)."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj


def write_json(path: str | Path, record: Any) -> None:
    """`record` as strict JSON (see `jsonable`), indented."""
    Path(path).write_text(json.dumps(jsonable(record), indent=2, default=str))


def default_data_dir() -> str:
    return os.environ.get("HPSEARCH_DATA_DIR") or str(REPO.parent / "shared" / "datasets")


def parse_workers(value: str) -> str:
    """argparse type of a worker count: a whole number >= 1, or `auto`."""
    text = value.strip().lower()
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"{value!r}: expected a whole number >= 1 or auto")


def _whole(value: str, least: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a whole number >= {least}") from None
    if number < least:
        raise argparse.ArgumentTypeError(f"{value!r}: must be at least {least}")
    return number


def positive_int(value: str) -> int:
    """argparse type of a count: a whole number >= 1."""
    return _whole(value, 1)


def nonnegative_int(value: str) -> int:
    """argparse type of a count that may be 0."""
    return _whole(value, 0)


def _finite(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a finite number")
    return number


def positive_float(value: str) -> float:
    """argparse type of a duration or period: a number > 0 (0 would mean "no limit" to some
    of what it is passed to, e.g. a worker's timeout_s)."""
    number = _finite(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: must be greater than 0")
    return number


def nonnegative_float(value: str) -> float:
    """argparse type of a duration that may be 0."""
    number = _finite(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: must be at least 0")
    return number


def resolve_device(name: str) -> str:
    """`auto` -> `cuda` when a GPU is visible, else `cpu`."""
    import torch

    if name not in ("auto", "cpu", "cuda"):
        raise BenchError(f"--device: {name!r}: must be one of auto, cpu, cuda")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device: 'cuda': CUDA is not available on this machine")
    return name


def environment(device: str, gpu: str | None) -> dict[str, Any]:
    """Date, host, versions and hardware, for the JSON record."""
    import optuna
    import torch
    import torchvision
    from hpsearch import __version__

    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "host": socket.gethostname(),
        "machine": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "optuna": optuna.__version__,
        "hpsearch": __version__,
        "device": device,
    }
    if device == "cuda":
        index = int(gpu) if gpu and gpu.isdigit() else 0
        env["gpu"] = torch.cuda.get_device_name(index)
        env["gpu_count"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            env["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
            pynvml.nvmlShutdown()
    return env


def load_study_config(study: str, sets: Sequence[str], data_dir: str) -> StudyConfig:
    """The study with `sets` applied, validated, and its data checked (one-line errors)."""
    cfg = load_config(study, list(sets), data_dir=str(Path(data_dir).resolve()))
    missing = not Path(data_dir).is_dir() and not cfg.dataset.download
    if cfg.dataset.name != "synthetic" and missing:
        raise BenchError(
            f"--data-dir: {data_dir}: no such folder (it should hold the dataset, e.g. "
            "flowers-102/; pass --data-dir or set HPSEARCH_DATA_DIR)"
        )
    from hpsearch.runner import check_dataset

    check_dataset(cfg)
    return cfg


def warm_cache(cfg: StudyConfig, workdir: Path) -> float:
    """Decode the study's splits into `workdir/cache` (the fast path's uint8 cache) the way its
    trials will, so that no timed launch pays the one-time decode. Returns seconds spent."""
    from hpsearch.trainer import data

    t0 = time.perf_counter()
    splits = ["train", "val"] + (["test"] if cfg.trainer.evaluate_test else [])
    sources = [s for s in (data.get_source(cfg, split) for split in splits) if s is not None]
    for size in cache_sizes(cfg):
        if data.use_fast_path(cfg, sources, size):
            for src in sources:
                data.load_or_build_cache(src, size, workdir, cfg.dataset.on_corrupt)
    return time.perf_counter() - t0


def cache_sizes(cfg: StudyConfig) -> list[int]:
    """The cache sizes (px) the study's trials read: one per image_size choice when the study
    searches it from a list and pins no dataset.cache_size, else the one its defaults give.
    (A searched int range would need one cache per size: its trials build those.)"""
    from hpsearch.config import CategoricalParam
    from hpsearch.trainer.trial import cache_size

    space = cfg.search_space.get("image_size")
    if isinstance(space, CategoricalParam):
        hps = [cfg.resolve_params({"image_size": s}) for s in space.choices]
    else:
        hps = [cfg.resolve_params({})]
    return sorted({cache_size(cfg, hp) for hp in hps})


def share_cache(shared: Path, workdir: Path) -> None:
    """A fresh work folder whose `cache/` is the shared, already decoded one."""
    workdir.mkdir(parents=True, exist_ok=True)
    (shared / "cache").mkdir(parents=True, exist_ok=True)
    link = workdir / "cache"
    if not link.exists():
        link.symlink_to((shared / "cache").resolve(), target_is_directory=True)


def launch_args(
    study: str,
    sets: Sequence[str],
    *,
    data_dir: str,
    workdir: Path,
    device: str,
    gpu: str | None,
    workers: int | str,
    trials: int | None = None,
    timeout_s: float | None = None,
    max_restarts: int = 3,
    max_retries: int | None = None,
) -> list[str]:
    """The `hpsearch launch` argument list: a journal in `workdir`, no MLflow.

    `max_restarts` bounds the restarts of a worker process that died; `max_retries` (None:
    the launch's default, 2) the re-queued retries of a trial whose worker died or was
    interrupted. A bench that wants every trial run once, by one worker, needs both at 0."""
    args = [
        "--study", study,
        "--workers", str(workers),
        "--workdir", str(workdir),
        "--storage", str(journal_path(workdir)),
        "--data-dir", str(Path(data_dir).resolve()),
        "--device", device,
        "--no-tracking",
        "--max-restarts", str(max_restarts),
    ]  # fmt: skip
    if max_retries is not None:
        args += ["--max-retries", str(max_retries)]
    if device == "cuda":
        args += ["--gpus", gpu or "0"]
    if trials is not None:
        args += ["--trials", str(trials)]
    if timeout_s is not None:
        args += ["--timeout", f"{timeout_s:g}"]
    for item in sets:
        args += ["--set", item]
    return args


def journal_path(workdir: Path) -> Path:
    return workdir.resolve() / "optuna.journal"


@dataclass
class LaunchRun:
    returncode: int
    wall_s: float
    started: dt.datetime  # local naive time, like Optuna's trial datetimes
    stops: list[str] = field(default_factory=list)  # signals the bench had to send
    log: Path | None = None
    interrupted: bool = False  # the bench itself got Ctrl-C or SIGTERM (its time limit)

    def tail(self, n: int = 5) -> str:
        if self.log is None or not self.log.is_file():
            return ""
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        return "\n".join(lines[-n:])


def run_launch(
    args: Sequence[str],
    log: Path,
    hard_stop_s: float | None = None,
    kill_grace_s: float = 30.0,
    echo: bool = False,
    keep_on_interrupt: bool = False,
) -> LaunchRun:
    """Run `hpsearch launch ARGS` (the real CLI) to its end, output to `log`.

    At `hard_stop_s` seconds the bench does what Ctrl-C does: SIGTERM (running trials
    checkpoint at their next epoch and are re-queued), a second SIGTERM `kill_grace_s` later
    (workers killed), then SIGKILL. Ctrl-C or SIGTERM to the bench (`timeout`) stops the
    launch the same way before the bench exits (the second SIGTERM `STOP_GRACE_S` after the
    first), so that no worker outlives it;
    then KeyboardInterrupt is raised, or with `keep_on_interrupt` the run is returned marked
    `interrupted`, so that what the study finished can still be read and written.
    """
    cmd = [sys.executable, "-m", "hpsearch.cli", "launch", *args]
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now()
    t0 = time.monotonic()
    stops: list[str] = []
    interrupted = False
    previous = signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # the bench decides when the launcher gets a signal
            )
            try:
                _supervise(proc, log, t0, hard_stop_s, kill_grace_s, stops, echo)
            except KeyboardInterrupt:
                # graceful, kill workers, kill the launcher
                for grace in (STOP_GRACE_S, 10.0, 0.0):
                    _signal(proc, stops)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=grace)
                    if proc.poll() is not None:
                        break
                if not keep_on_interrupt:
                    raise
                interrupted = True
    finally:
        signal.signal(signal.SIGTERM, previous)
    return LaunchRun(proc.returncode, time.monotonic() - t0, started, stops, log, interrupted)


def load_launched_study(name: str, workdir: Path, run: LaunchRun) -> Any:
    """The study a launch made. A launch that failed before it made one (a bad option, the
    GPU probe, no data) is a BenchError with its exit code and the last lines of its log,
    which goes with the bench's folder otherwise."""
    from hpsearch.errors import HpsearchError
    from hpsearch.query import load_study

    try:
        return load_study(name, storage=str(journal_path(workdir)))
    except HpsearchError as exc:
        tail = run.tail(8).replace("\n", " | ")
        raise BenchError(
            f"the launch made no study (exit code {run.returncode}): {tail or exc}"
        ) from exc


def launched_workers(run: LaunchRun) -> tuple[int | None, str]:
    """How many workers the launch ran (its "study S: T trials, W workers" line) and, with
    --workers auto, the reason it gave."""
    log = run.log.read_text(errors="replace") if run.log is not None and run.log.is_file() else ""
    found = re.search(r"^study \S+: \d+ trials?, (\d+) workers?", log, re.MULTILINE)
    reason = re.search(r"^--workers auto: (.*)$", log, re.MULTILINE)
    return (int(found.group(1)) if found else None), (reason.group(1) if reason else "")


# The launcher's lines for a worker that died (launcher._on_exit, the stale-trial check).
WORKER_DIED = re.compile(r"\bworker \d+ died \(.*$|\bits worker was gone: .*$", re.M)


def worker_deaths(run: LaunchRun) -> list[str]:
    """The launch log's lines saying a worker died (its trial failed, perhaps re-queued)."""
    log = run.log.read_text(errors="replace") if run.log is not None and run.log.is_file() else ""
    return [m.group(0).strip() for m in WORKER_DIED.finditer(log)]


def raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _supervise(
    proc: subprocess.Popen[bytes],
    log: Path,
    t0: float,
    hard_stop_s: float | None,
    kill_grace_s: float,
    stops: list[str],
    echo: bool,
) -> None:
    deadline = None if hard_stop_s is None else t0 + hard_stop_s
    shown = 0
    while proc.poll() is None:
        time.sleep(0.25)
        if echo:
            shown = _echo_new(log, shown)
        if deadline is not None and time.monotonic() >= deadline:
            _signal(proc, stops)
            deadline = time.monotonic() + (kill_grace_s if len(stops) < 2 else 10.0)
    if echo:
        _echo_new(log, shown)


def _signal(proc: subprocess.Popen[bytes], stops: list[str]) -> None:
    """The launcher's next stop signal: SIGTERM (graceful), SIGTERM (kill its workers), then
    SIGKILL to its process group."""
    with contextlib.suppress(ProcessLookupError):
        if len(stops) < 2:
            proc.send_signal(signal.SIGTERM)
            stops.append("SIGTERM")
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            stops.append("SIGKILL")


def _echo_new(log: Path, shown: int) -> int:
    """Print the launcher's new progress lines; returns how many bytes were shown."""
    try:
        with open(log, "rb") as fh:
            fh.seek(shown)
            chunk = fh.read()
    except OSError:
        return shown
    end = chunk.rfind(b"\n") + 1
    if end:
        for line in chunk[:end].decode(errors="replace").splitlines():
            print(f"    | {line}", flush=True)
    return shown + end


class GpuWatch:
    """Device utilization of one GPU during a launch, sampled with hpsearch's NVML sampler in
    this process. On the CPU, or without NVML, `summary` stays empty (reported "n/a")."""

    def __init__(self, device: str, gpu: str | None, interval_s: float = 0.5) -> None:
        self.device = device
        self.gpu = gpu or "0"
        self.interval_s = interval_s
        self.summary: dict[str, float] = {}
        # (local naive time, like Optuna's trial datetimes; device utilization %)
        self.series: list[tuple[dt.datetime, float]] = []
        self._sampler: Any = None

    def _record(self, metrics: Mapping[str, float]) -> None:  # the sampler's sink
        util = metrics.get("system/gpu_utilization")
        if util is not None:
            self.series.append((dt.datetime.now(), float(util)))

    def mean_between(self, start: dt.datetime | None, end: dt.datetime | None) -> float | None:
        """Mean device utilization of the samples taken in [start, end]; None if none."""
        if start is None or end is None:
            return None
        values = [u for t, u in self.series if start <= t <= end]
        return sum(values) / len(values) if values else None

    def __enter__(self) -> GpuWatch:
        if self.device == "cuda":
            from hpsearch.packing import gpus_through_mask
            from hpsearch.tracking.gpu import GpuSampler

            # The launcher sets CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA index N is NVML index N.
            # `--gpu N` counts the GPUs this process sees, as the launch's `--gpus` does: under
            # CUDA_VISIBLE_DEVICES=2 the worker's GPU is the machine's 2, not NVML's 0.
            gpu = gpus_through_mask([self.gpu])[0]
            sampler = GpuSampler(self._record, interval_s=self.interval_s, visible_devices=gpu)
            if sampler.start():
                self._sampler = sampler
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sampler is not None:
            self.summary = self._sampler.stop()
            self.summary["samples"] = float(self._sampler.samples_taken)

    @property
    def utilization(self) -> float | None:
        return self.summary.get("system/gpu_utilization_mean")


def trial_timings(workdir: Path) -> dict[str, float]:
    """Means of the workers' per-trial timings (`<workdir>/timings/*.jsonl`), when written."""
    rows: list[dict[str, Any]] = []
    for path in sorted((workdir / "timings").glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    out: dict[str, float] = {"trials": float(len(rows))} if rows else {}
    keys = ("ask_ms", "suggest_ms", "startup_s", "admission_wait_s", "setup_s", "epochs_s",
            "finish_s", "tell_ms", "trial_s")  # fmt: skip
    for key in keys:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
        if values:
            out[f"{key}_mean"] = statistics.fmean(values)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`; NaN when there are none.

    p50 is `statistics.median` (the mean of the middle two for an even count; a rounded
    rank would pick one of them, and Python's round() picks the even one). Other q are
    linear between the closest ranks (numpy's default, PERCENTILE.INC): with n values the
    p99 sits at rank 0.99 (n - 1), so under 100 values it lies between the two largest and
    says little about the tail; the benches record n beside it for that reason."""
    if not values:
        return float("nan")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q={q}: must be within 0..100")
    s = sorted(values)
    if q == 50:
        return float(statistics.median(s))
    pos = q / 100.0 * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def fmt(value: float | None, spec: str = ".1f", missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def seconds_since(start: dt.datetime, when: dt.datetime | None) -> float | None:
    return None if when is None else (when - start).total_seconds()


# --- PostgreSQL: throwaway databases for the benchmarks -----------------------------


def _pg_connect(base: str) -> Any:
    import psycopg2

    try:
        conn = psycopg2.connect(f"{base.rstrip('/')}/postgres", connect_timeout=5)
    except psycopg2.Error as exc:
        first = " ".join(str(exc).split())[:200]
        raise BenchError(
            f"PostgreSQL at {base} is not reachable ({first}); start it: "
            "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
        ) from exc
    conn.autocommit = True
    return conn


def pg_version(base: str) -> str:
    conn = _pg_connect(base)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW server_version")
            return str(cur.fetchone()[0])
    finally:
        conn.close()


def create_database(base: str, name: str) -> str:
    from psycopg2 import sql

    conn = _pg_connect(base)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
            cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    finally:
        conn.close()
    return f"{base.rstrip('/')}/{name}"


def drop_database(base: str, name: str) -> None:
    from psycopg2 import sql

    conn = _pg_connect(base)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
    finally:
        conn.close()


# --------------------------------------------------------------------------- CPU accounting

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = Path("/proc")


@dataclass(frozen=True)
class ProcInfo:
    """One process as /proc shows it."""

    ppid: int
    start: int  # clock ticks after boot: (pid, start) names a process, a pid alone is reused
    cpu_s: float  # user + system CPU seconds so far
    cmd: str  # command line, or "(comm)" once it exits (its cmdline then reads empty)


def parse_stat(stat: str) -> tuple[int, int, float]:
    """(ppid, start ticks, user + system CPU s) from a /proc/PID/stat or task/TID/stat line."""
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": field 3 is fields[0]
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / _CLK_TCK


def read_process(pid: int, proc: Path = PROC) -> ProcInfo | None:
    """The process `pid`, or None once it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_bytes().decode(errors="replace")
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    try:
        ppid, start, cpu = parse_stat(stat)
    except (IndexError, ValueError):  # torn or not a stat line
        return None
    cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return ProcInfo(ppid, start, cpu, cmd or stat[stat.find("(") : stat.rfind(")") + 1])


def process_table(proc: Path = PROC) -> dict[int, ProcInfo]:
    """Every process now running, by pid."""
    try:
        pids = [int(p) for p in os.listdir(proc) if p.isdigit()]
    except OSError:  # no /proc (not Linux): nothing is counted
        return {}
    table = {}
    for pid in pids:
        info = read_process(pid, proc)
        if info is not None:
            table[pid] = info
    return table


def serves_database(cmd: str, databases: Sequence[str]) -> bool:
    """Whether `cmd` is the process title of a PostgreSQL backend connected to one of
    `databases`: "postgres: [CLUSTER: ]USER DATABASE HOST(PORT) STATE"."""
    if not databases or not cmd.startswith("postgres: "):
        return False
    words = cmd.split()[1:]
    if words and words[0].endswith(":"):  # cluster_name (Debian's "15/main:")
        words = words[1:]
    return len(words) >= 2 and words[1] in databases


def own_processes(
    table: Mapping[int, ProcInfo], roots: Sequence[int], databases: Sequence[str] = ()
) -> set[int]:
    """The pids in `table` that a bench run owns: the descendants of `roots` (not the roots
    themselves) and the PostgreSQL backends serving its `databases`. Every other process on
    the machine (a CI, another user's jobs, other databases' backends, PostgreSQL's shared
    background processes) is left out."""
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        children.setdefault(info.ppid, []).append(pid)
    out: set[int] = set()
    todo = [c for r in roots for c in children.get(r, [])]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    out |= {pid for pid, info in table.items() if serves_database(info.cmd, databases)}
    return out


def database_of(url: str) -> str | None:
    """The database a postgresql:// URL names, if any."""
    from urllib.parse import urlsplit

    if not url.startswith(("postgresql", "postgres:")):
        return None
    name = urlsplit(url).path.strip("/")
    return name or None


def classify(cmd: str) -> str:
    """A process's role in a bench run, from its command line."""
    if cmd.startswith("postgres"):
        return "postgres"
    if "mlflow" in cmd and ("server" in cmd or "uvicorn" in cmd or "gunicorn" in cmd):
        return "mlflow-server"
    if "hpsearch.cli launch" in cmd:
        return "launcher"
    if "hpsearch.cli worker" in cmd:
        return "worker"
    if "multiprocessing" in cmd and ("spawn_main" in cmd or "forkserver" in cmd):
        return "helper"
    if "--child" in cmd:
        return "plain"
    return "other"


class CpuSampler:
    """CPU seconds by process role (see `classify`) over a span of time, of the bench's own
    processes only (`own_processes`: the descendants of this process, so the launcher, its
    workers and their helpers, the plain loops and the MLflow server the bench started, and
    the PostgreSQL backends serving `databases`): a thread samples /proc every `interval_s`.
    A process that exits between samples loses at most that much of its CPU; long-lived ones
    (an MLflow server, a backend) are counted exactly as the difference across the span. A
    process once seen as the bench's stays counted when its parent exits (reparented).
    Linux only; elsewhere `totals()` is empty."""

    def __init__(
        self,
        interval_s: float = 0.2,
        databases: Sequence[str] = (),
        proc: Path = PROC,
        root: int | None = None,  # whose descendants count (default: this process)
    ) -> None:
        self.interval_s = interval_s
        self.databases = tuple(databases)
        self._proc = proc
        self._root = os.getpid() if root is None else root
        self._base: dict[tuple[int, int], float] = {}  # (pid, start) -> CPU s at start()
        self._last: dict[tuple[int, int], tuple[float, str]] = {}  # the bench's, last seen
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        table = process_table(self._proc)
        mine = own_processes(table, [self._root], self.databases)
        for pid, info in table.items():
            key = (pid, info.start)
            if pid in mine or key in self._last:
                known = self._last.get(key)
                # An exiting process's cmdline reads empty: keep the one seen while it ran.
                cmd = known[1] if known is not None and info.cmd.startswith("(") else info.cmd
                self._last[key] = (info.cpu_s, cmd)

    def start(self) -> CpuSampler:
        self._base = {(pid, i.start): i.cpu_s for pid, i in process_table(self._proc).items()}

        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self._sample()

        self._thread = threading.Thread(target=loop, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return self.totals()

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, (cpu, cmd) in self._last.items():
            role = classify(cmd)
            spent = cpu - self._base.get(key, 0.0)
            if spent > 0:
                out[role] = out.get(role, 0.0) + spent
        return {k: round(v, 2) for k, v in sorted(out.items())}
