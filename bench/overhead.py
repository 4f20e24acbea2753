"""What hpsearch costs over a plain Optuna loop: the same study and trainer, both on PostgreSQL.

  plain     a plain Optuna ask/tell loop (what ``study.optimize`` does, with the calls timed)
            in its own Python process per worker: ``optuna.create_study`` with the study's
            sampler and pruner, ``hpsearch.study.suggest``, ``hpsearch.trainer.train`` with a
            report callback doing ``trial.report`` + ``trial.should_prune``, then ``tell``.
            No MLflow, no heartbeats, no checkpoints (``--plain-checkpoint`` adds the
            trainer's per-epoch checkpoint writes), one ``WarmCache`` per process like a worker.
  hpsearch  the real CLI, ``hpsearch launch --storage postgresql://... --tracking-uri <an mlflow
            server this script starts>``, timed from spawn to exit.

Both run the same resolved study (sampler seed, pruner, trials, epochs), the same per-trial
seeds, the same threads per worker and the same device, each in a fresh throwaway database
(schema created before the clock starts, like the compose file's optuna-schema job). The
decoded-image cache is built once by an untimed warm-up and shared by both sides (their work
folders link ``cache/`` to ``<--cache-workdir>/cache``). With one worker both sides should draw
the same parameters and prune alike; the report says whether they did.

Reported per side: wall time (spawn to exit) and its parts (start-up = spawn to the first
trial's ask, the trial loop, shut-down = last tell to exit), trial counts, the gap between one
trial's tell and the next ask, and p50/p99 of ask, suggest, per-trial start-up, report (per
epoch), MLflow log hand-off (per epoch; hpsearch only), tell, the whole trial, the trainer's
own epoch time per trial and the rest of the trial (trial - epochs). hpsearch's latencies come from
the worker's ``<workdir>/timings/<worker-id>.jsonl`` (shown as n/a when the worker writes none).
Target: hpsearch wall time <= 1.10x the plain loop's.

Needs PostgreSQL (``--pg``, trust auth; when it is down:
``pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start``).

Example (CPU, about 3 minutes on 2 cores; --repeats 2 doubles it and alternates the order):
    python bench/overhead.py --study tiny --trials 6 --epochs 2 --workers 1 --device cpu \\
        --json bench-overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from common import (
    STOP_GRACE_S,
    BenchError,
    CpuSampler,
    cache_sizes,
    check_output_path,
    create_database,
    database_of,
    drop_database,
    jsonable,
    percentile,
    pg_version,
    positive_float,
    positive_int,
    run_main,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
TARGET_RATIO = 1.10
DB_PREFIX = "hpsearch_bench_overhead"
SIDES = ("plain", "hpsearch")
# Per-trial timings, one JSON object a line: what the hpsearch worker writes under
# <workdir>/timings/ and what the plain loop here writes in the same format.
LATENCIES = (
    ("ask_ms", "ask ms"),
    ("suggest_ms", "suggest ms"),
    ("startup_s", "trial start-up s"),
    ("report_ms", "report ms (per epoch)"),
    ("log_ms", "log ms (per epoch)"),
    ("tell_ms", "tell ms"),
    ("trial_s", "trial s"),
    ("train_s", "trainer epochs s"),  # the trainer's own epoch_seconds, summed per trial
    ("overhead_s", "trial - epochs s"),  # per trial: everything but the epochs
)


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--study", default="tiny", help="study name (studies/NAME.yaml) or YAML path")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a study field, both sides (repeatable)",
    )
    p.add_argument(
        "--trials", type=positive_int, default=None, help="trials per side (default: study's)"
    )
    p.add_argument(
        "--epochs", type=positive_int, default=None, help="budget.max_epochs (default: study's)"
    )
    p.add_argument("--workers", type=positive_int, default=1, help="worker processes per side")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--data-dir",
        default=os.environ.get("HPSEARCH_DATA_DIR", str(REPO.parent / "shared" / "datasets")),
        help="folder holding flowers-102/ (default: $HPSEARCH_DATA_DIR, else ../shared/datasets)",
    )
    p.add_argument(
        "--pg",
        default="postgresql://postgres@127.0.0.1:5432",
        metavar="URL",
        help="PostgreSQL server (no database): a fresh database per side is created and dropped",
    )
    p.add_argument(
        "--cache-workdir",
        default=".hpsearch",
        help="the shared decoded-image cache lives in DIR/cache (built by the warm-up)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=1, help="pairs of runs, order alternating"
    )
    p.add_argument("--order", default="plain-first", choices=["plain-first", "hpsearch-first"])
    p.add_argument(
        "--plain-checkpoint",
        action="store_true",
        help="the plain loop writes the trainer's per-epoch checkpoints too (isolates what "
        "fault tolerance costs from what coordination costs)",
    )
    p.add_argument("--side-timeout", type=positive_float, default=1800.0, help="seconds per side")
    p.add_argument("--keep", action="store_true", help="keep the temp folder and databases")
    p.add_argument("--json", dest="json_path", default=None, help="write all numbers here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: a subprocess
    args = p.parse_args(argv)
    if not args.pg.startswith(("postgresql://", "postgres://")):
        p.error(f"--pg: {args.pg!r}: expected postgresql://user@host:port")
    # The sides run in a scratch folder (cwd): a relative path would name another folder there.
    args.data_dir = str(Path(args.data_dir).resolve())
    return args


# --------------------------------------------------------------------------- statistics


def pct(values: list[float], q: float) -> float:
    """p50 the median, others linear between ranks (common.percentile); NaN when empty."""
    return percentile(values, q)


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p99": pct(values, 99),
        "mean": statistics.fmean(values) if values else float("nan"),
        "max": max(values) if values else float("nan"),
    }


def flat(records: list[dict[str, Any]], key: str) -> list[float]:
    out: list[float] = []
    for r in records:
        v = r.get(key)
        if isinstance(v, list):
            out += [float(x) for x in v]
        elif isinstance(v, int | float):
            out.append(float(v))
    return out


def fmt(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}f}"


def pair(s: dict[str, Any] | None, digits: int) -> str:
    if not s or not s["n"]:
        return "n/a"
    return f"{fmt(s['p50'], digits)} / {fmt(s['p99'], digits)}"


# --------------------------------------------------------------------------- PostgreSQL


def driver_url(url: str) -> str:
    """The URL with an installed driver (SQLAlchemy 2.1 defaults bare postgresql:// to
    psycopg 3, which hpsearch does not install): what hpsearch itself hands to Optuna."""
    from hpsearch.storage import normalize_url

    return normalize_url(url)


def own_database(url: str) -> list[str]:
    """The side's database, whose PostgreSQL backends the CPU figures count."""
    name = database_of(url)
    return [name] if name else []


def init_schema(url: str) -> None:
    """Optuna's tables, created before the clock starts (both sides alike)."""
    import optuna

    storage = optuna.storages.RDBStorage(driver_url(url))
    storage.engine.dispose()


def _epoch_seconds(history: Any) -> float | None:
    """Sum of the trainer's epoch_seconds from hpsearch's `history` user attribute."""
    if not isinstance(history, list) or not history:
        return None
    try:
        return float(sum(float(h["epoch_seconds"]) for h in history))
    except (KeyError, TypeError, ValueError):
        return None


def study_trials(url: str, name: str) -> list[dict[str, Any]]:
    """number, state, params, value, ask/tell wall-clock times, worker of every trial."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(driver_url(url))
    try:
        try:
            summaries = optuna.get_all_study_names(storage)
        except Exception:
            summaries = []
        if name not in summaries:
            return []
        study = optuna.load_study(study_name=name, storage=storage)
        rows = []
        for t in study.get_trials(deepcopy=False):
            rows.append(
                {
                    "number": t.number,
                    "state": t.state.name.lower(),
                    "params": dict(t.params),
                    "value": t.value if len(study.directions) == 1 else t.values,
                    "epochs_reported": len(t.intermediate_values),
                    "start": t.datetime_start.timestamp() if t.datetime_start else None,
                    "complete": t.datetime_complete.timestamp() if t.datetime_complete else None,
                    "worker": t.user_attrs.get("worker"),
                    "train_s": _epoch_seconds(t.user_attrs.get("history")),
                }
            )
        return rows
    finally:
        storage.engine.dispose()


# --------------------------------------------------------------------------- processes


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("HPSEARCH_STORAGE", "MLFLOW_TRACKING_URI", "HPSEARCH_WORKDIR"):
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def plain_env(workers: int, device: str = "cpu") -> dict[str, str]:
    """What `hpsearch launch` gives each of its workers (launcher._spawn), minus storage:
    a share of the cores' threads on the CPU only (a GPU worker keeps torch's default)."""
    env = child_env()
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if not device.startswith("cuda"):
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    return env


@dataclass
class Proc:
    """A child process whose output lines are timestamped and copied to a log file."""

    popen: subprocess.Popen[str]
    log_path: Path
    t0: float
    lines: list[tuple[float, str]] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @classmethod
    def start(cls, cmd: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> Proc:
        t0 = time.perf_counter()
        popen = subprocess.Popen(
            cmd,
            env=env,
            cwd=str(cwd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own group: a timeout can end all of it
        )
        proc = cls(popen, log_path, t0)
        proc._reader = threading.Thread(target=proc._read, daemon=True)
        proc._reader.start()
        return proc

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.popen.stdout:
                self.lines.append((time.perf_counter() - self.t0, line.rstrip("\n")))
                log.write(line)
                log.flush()

    def wait(self, deadline: float) -> int:
        """Exit code; SIGTERM (graceful for hpsearch) at the deadline, SIGKILL 60 s later."""
        try:
            code = self.popen.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise BenchError(
                f"{_shown(self.popen.args)}... still running after the side timeout; "
                f"see {self.log_path}"
            ) from None
        if self._reader is not None:
            self._reader.join(timeout=10)
        return code

    def stop_now(self) -> None:
        """Ctrl-C or SIGTERM to the bench, as common.run_launch stops a launch: SIGTERM to the
        child's group (graceful), a second one `STOP_GRACE_S` later (the launcher kills its
        workers at once), SIGKILL to the group 10 s after that. A plain loop dies at the
        first."""
        steps = ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0))
        for sig, grace_s in steps:
            if self.popen.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace_s)

    def kill(self) -> None:
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)

    def tail(self, n: int = 3) -> str:
        text = " | ".join(line for _, line in self.lines[-n:] if line.strip())
        return text[-600:] or "(no output)"


def _shown(args: Any) -> str:
    """The first words of a Popen's command, for messages."""
    return " ".join(map(str, args[:4])) if isinstance(args, list) else str(args)


def run_child(spec: dict[str, Any], root: Path, tag: str, env: dict[str, str]) -> dict[str, Any]:
    """Run this script as `--child spec` to completion; returns the JSON it wrote."""
    spec_path = root / f"{tag}.spec.json"
    out_path = root / f"{tag}.out.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out_path)}))
    proc = Proc.start(
        [sys.executable, str(SCRIPT), "--child", str(spec_path)], env, root, root / f"{tag}.log"
    )
    try:
        code = proc.wait(time.perf_counter() + 1800.0)
    except KeyboardInterrupt:
        proc.stop_now()
        raise
    if code != 0:
        raise BenchError(f"{tag} failed (exit {code}): {proc.tail(1)}")
    return dict(json.loads(out_path.read_text()))


def link_cache(workdir: Path, cache_workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (cache_workdir / "cache").mkdir(parents=True, exist_ok=True)
    (workdir / "cache").symlink_to((cache_workdir / "cache").resolve(), target_is_directory=True)


def read_timings(folder: Path) -> list[dict[str, Any]] | None:
    """The JSON lines of every <folder>/*.jsonl; None when the folder is absent."""
    if not folder.is_dir():
        return None
    records = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                with contextlib.suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
    return records


# --------------------------------------------------------------------------- one side


@dataclass
class Side:
    side: str
    repeat: int
    wall_s: float
    exit_code: int
    trials: list[dict[str, Any]]
    timings: list[dict[str, Any]] | None
    log: str
    ready_s: float | None = None  # hpsearch: spawn to the launcher's first line
    startup_s: float | None = None  # spawn to the first trial's ask
    loop_s: float | None = None  # first ask to last tell
    shutdown_s: float | None = None  # last tell to exit
    gaps_s: list[float] = field(default_factory=list)  # a worker's tell to its next ask
    counts: dict[str, int] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by process role

    def finish(self, spawned_at: float, exited_at: float) -> None:
        counts: dict[str, int] = {}
        for t in self.trials:
            counts[t["state"]] = counts.get(t["state"], 0) + 1
        self.counts = counts
        starts = [t["start"] for t in self.trials if t["start"] is not None]
        ends = [t["complete"] for t in self.trials if t["complete"] is not None]
        if starts:
            self.startup_s = min(starts) - spawned_at
        if starts and ends:
            self.loop_s = max(ends) - min(starts)
        if ends:
            self.shutdown_s = exited_at - max(ends)
        by_number = {t["number"]: t for t in self.trials}
        for r in self.timings or []:
            t_ = by_number.get(int(r["trial"]))
            if r.get("train_s") is None and t_ is not None:
                r["train_s"] = t_["train_s"]
            if r.get("train_s") is not None and r.get("trial_s") is not None:
                r["overhead_s"] = float(r["trial_s"]) - float(r["train_s"])
        worker_of = {int(r["trial"]): str(r.get("worker")) for r in self.timings or []}
        by_worker: dict[str, list[dict[str, Any]]] = {}
        for t in self.trials:
            w = worker_of.get(t["number"]) or t.get("worker") or "-"
            by_worker.setdefault(str(w), []).append(t)
        for rows in by_worker.values():
            rows = sorted((r for r in rows if r["start"] is not None), key=lambda r: r["start"])
            for a, b in itertools.pairwise(rows):
                if a["complete"] is not None:
                    self.gaps_s.append(b["start"] - a["complete"])


def side_overrides(args: argparse.Namespace, n_trials: int, epochs: int) -> list[str]:
    return [*args.overrides, f"budget.n_trials={n_trials}", f"budget.max_epochs={epochs}"]


def run_hpsearch(
    args: argparse.Namespace, ctx: dict[str, Any], url: str, root: Path, rep: int
) -> Side:
    workdir = root / f"hpsearch-{rep}"
    link_cache(workdir, ctx["cache_workdir"])
    cmd = [
        sys.executable, "-m", "hpsearch.cli", "launch",
        "--study", ctx["study_file"],
        "--storage", url,
        "--tracking-uri", ctx["tracking_uri"],
        "--workers", str(args.workers),
        "--trials", str(ctx["n_trials"]),
        "--workdir", str(workdir),
        "--device", args.device,
        "--data-dir", args.data_dir,
    ]  # fmt: skip
    for item in ctx["overrides"]:
        cmd += ["--set", item]
    spawned_at = time.time()
    cpu = CpuSampler(databases=own_database(url)).start()
    proc = Proc.start(cmd, child_env(), root, root / f"hpsearch-{rep}.log")
    try:
        code = proc.wait(time.perf_counter() + args.side_timeout)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (`timeout`): stop the launch and its workers
        proc.stop_now()
        raise
    finally:
        proc.kill()  # a no-op once it exited
        cpu_s = cpu.stop()
    wall = time.perf_counter() - proc.t0
    exited_at = time.time()
    if code != 0:
        raise BenchError(f"hpsearch launch failed (exit {code}): {proc.tail()}")
    ready = next((t for t, line in proc.lines if line.startswith("study ")), None)
    side = Side(
        "hpsearch",
        rep,
        wall,
        code,
        study_trials(url, ctx["study_name"]),
        read_timings(workdir / "timings"),
        str(proc.log_path),
        ready_s=ready,
        cpu_s=cpu_s,
    )
    side.finish(spawned_at, exited_at)
    return side


def run_plain(
    args: argparse.Namespace, ctx: dict[str, Any], url: str, root: Path, rep: int
) -> Side:
    workdir = root / f"plain-{rep}"
    link_cache(workdir, ctx["cache_workdir"])
    n, w = ctx["n_trials"], args.workers
    quotas = [n // w + (1 if i < n % w else 0) for i in range(w)]
    env = plain_env(w, ctx["device"])
    procs: list[Proc] = []
    spawned_at = time.time()
    cpu = CpuSampler(databases=own_database(url)).start()
    t0 = time.perf_counter()
    try:
        for i, quota in enumerate(quotas):
            spec = {
                "mode": "plain",
                "study_file": ctx["study_file"],
                "overrides": ctx["overrides"],
                "data_dir": args.data_dir,
                "storage": url,
                "device": args.device,
                "workdir": str(workdir),
                "worker": f"plain:w{i}",
                "stream": i,  # the seed stream hpsearch's launcher gives its worker i
                "trials": quota,
                "checkpoint": bool(args.plain_checkpoint),
                "timings": str(workdir / "timings" / f"plain-w{i}.jsonl"),
            }
            spec_path = root / f"plain-{rep}-w{i}.spec.json"
            spec_path.write_text(json.dumps(spec))
            cmd = [sys.executable, str(SCRIPT), "--child", str(spec_path)]
            procs.append(Proc.start(cmd, env, root, root / f"plain-{rep}-w{i}.log"))
        deadline = t0 + args.side_timeout
        codes = [p.wait(deadline) for p in procs]
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (`timeout`): no plain loop outlives the bench
        for p in procs:
            p.stop_now()
        raise
    finally:
        for p in procs:
            p.kill()
        cpu_s = cpu.stop()
    wall = time.perf_counter() - t0
    exited_at = time.time()
    bad = [(p, c) for p, c in zip(procs, codes, strict=True) if c != 0]
    if bad:
        p, c = bad[0]
        raise BenchError(f"plain loop failed (exit {c}): {p.tail()}")
    side = Side(
        "plain",
        rep,
        wall,
        0,
        study_trials(url, ctx["study_name"]),
        read_timings(workdir / "timings"),
        str(procs[0].log_path),
        cpu_s=cpu_s,
    )
    side.finish(spawned_at, exited_at)
    return side


# --------------------------------------------------------------------------- children


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    from hpsearch.errors import HpsearchError

    try:
        if spec["mode"] == "warmup":
            out = warmup(spec)
        elif spec["mode"] == "plain":
            out = plain_loop(spec)
        else:
            print(f"unknown child mode {spec['mode']!r}", file=sys.stderr)
            return 2
    except HpsearchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if spec.get("out"):
        Path(spec["out"]).write_text(json.dumps(out))
    return 0


def warmup(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the decoded-image caches both sides will read, untimed; report the host."""
    import torch
    import torchvision
    from hpsearch.config import load_config
    from hpsearch.runner import check_dataset
    from hpsearch.trainer import data
    from hpsearch.trainer.trial import resolve_device

    cfg = load_config(spec["study_file"], spec["overrides"], data_dir=spec["data_dir"])
    check_dataset(cfg)
    device = resolve_device(spec["device"])
    splits = ["train", "val"] + (["test"] if cfg.trainer.evaluate_test else [])
    sources = [s for s in (data.get_source(cfg, name) for name in splits) if s is not None]
    t0 = time.perf_counter()
    built = 0
    sizes = cache_sizes(cfg)
    for size in sizes:
        if not data.use_fast_path(cfg, sources, size):
            continue  # streaming path: every epoch decodes, on both sides alike
        for src in sources:
            dec = data.load_or_build_cache(src, size, Path(spec["workdir"]), cfg.dataset.on_corrupt)
            built += int(dec.built)
    return {
        "cache_s": time.perf_counter() - t0,
        "caches_built": built,
        "cache_sizes_px": sizes,
        "device": str(device),
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
    }


def timed_report(
    trial: Any, sink: list[float], last_step: int | None = None
) -> Callable[[int, float], bool]:
    """The trainer's report callback: trial.report + should_prune, timed into `sink` (ms).

    As hpsearch's worker (search/reporting.py `TrialReports`, `last_step`): the value of the
    last epoch (budget.max_epochs) is recorded but never judged, so that both sides prune
    alike: a trial pruned there had paid for every epoch already."""

    def report(epoch: int, value: float) -> bool:
        t = time.perf_counter()
        trial.report(value, epoch)
        prune = False if last_step is not None and epoch >= last_step else trial.should_prune()
        sink.append(1000.0 * (time.perf_counter() - t))
        return bool(prune)

    return report


def plain_loop(spec: dict[str, Any]) -> dict[str, Any]:
    """The baseline: a plain Optuna ask/tell loop around the same trainer, every call timed.

    This is `study.optimize(objective, n_trials=N)` unrolled (optimize is ask, objective,
    tell), with the objective telling pruned trials PRUNED the way hpsearch's worker does
    (a pruned, diverged or out-of-memory trial is PRUNED, with its last reported value)."""
    import optuna
    from hpsearch.config import load_config
    from hpsearch.study import make_pruner, make_sampler, objective_values, suggest
    from hpsearch.trainer import TrainOptions, WarmCache, train
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg = load_config(spec["study_file"], spec["overrides"], data_dir=spec["data_dir"])
    kwargs: dict[str, Any] = {"directions": list(cfg.objective.directions)}
    if not cfg.objective.multi:
        kwargs = {"direction": cfg.objective.directions[0]}
    study = optuna.create_study(
        study_name=cfg.name,
        storage=driver_url(spec["storage"]),
        # Each worker its own seed stream, as hpsearch's workers draw (a shared seed would
        # have every worker train the same parameters).
        sampler=make_sampler(cfg, int(spec.get("stream", 0))),
        pruner=make_pruner(cfg),
        load_if_exists=True,  # several plain workers share one study
        **kwargs,
    )
    workdir = Path(spec["workdir"])
    timings = Path(spec["timings"])
    timings.parent.mkdir(parents=True, exist_ok=True)
    warm = WarmCache()
    for _ in range(int(spec["trials"])):
        t_ask = time.perf_counter()
        trial = study.ask()
        t_suggest = time.perf_counter()
        params = suggest(trial, cfg)
        t_setup = time.perf_counter()
        report_ms: list[float] = []
        report = timed_report(trial, report_ms, last_step=cfg.budget.max_epochs)
        ckpt = None
        if spec["checkpoint"] and cfg.trainer.checkpoint:
            ckpt = workdir / "checkpoints" / f"trial-{trial.number:05d}.pt"
        t_train = time.perf_counter()
        result = train(
            cfg,
            params,
            report,
            TrainOptions(
                device=spec["device"],
                workdir=workdir,
                checkpoint_path=ckpt,
                seed=cfg.trainer.seed + trial.number,  # what the worker uses
                warm=warm,
            ),
        )
        t_tell = time.perf_counter()
        reason = str(result.stop_reason)
        values = objective_values(
            cfg, result.best_val_acc, result.best_val_loss, result.train_seconds
        )
        if reason in ("pruned", "diverged", "out_of_memory") or values is None:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, values if cfg.objective.multi else values[0])
        t_end = time.perf_counter()
        record = {
            "trial": trial.number,
            "worker": spec["worker"],
            "ask_ms": 1000.0 * (t_suggest - t_ask),
            "suggest_ms": 1000.0 * (t_setup - t_suggest),
            "startup_s": (t_train - t_ask) + result.setup_seconds,
            "report_ms": report_ms,
            "log_ms": [],  # no MLflow in the plain loop
            "tell_ms": 1000.0 * (t_end - t_tell),
            "trial_s": t_end - t_ask,
            "train_s": float(sum(r.epoch_seconds for r in result.history)),
            "outcome": reason,
        }
        with open(timings, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"trial {trial.number}: {reason}", flush=True)
    return {}


# --------------------------------------------------------------------------- report


def side_stats(sides: list[Side]) -> dict[str, Any]:
    """Scalars: median over repeats; latencies: pooled over repeats."""

    def med(vals: list[float | None]) -> float | None:
        xs = [v for v in vals if v is not None]
        return statistics.median(xs) if xs else None

    records = [r for s in sides for r in (s.timings or [])]
    have_timings = any(s.timings is not None for s in sides)
    lat: dict[str, Any] = {}
    for key, _ in LATENCIES:
        values = flat(records, key)
        lat[key] = summary(values) if have_timings and values else None
    counts: dict[str, int] = {}
    for s in sides:
        for k, v in s.counts.items():
            counts[k] = counts.get(k, 0) + v
    return {
        "wall_s": med([s.wall_s for s in sides]),
        "ready_s": med([s.ready_s for s in sides]),
        "startup_s": med([s.startup_s for s in sides]),
        "loop_s": med([s.loop_s for s in sides]),
        "shutdown_s": med([s.shutdown_s for s in sides]),
        "gap_s": summary([g for s in sides for g in s.gaps_s]),
        "counts": counts,
        "timings_found": have_timings,
        "latency": lat,
        "cpu_s": {
            role: med([s.cpu_s.get(role) for s in sides])
            for role in sorted({r for s in sides for r in s.cpu_s})
        },
    }


def headline_ratio(pair_ratios: list[float]) -> float | None:
    """The median of the per-pair ratios (hpsearch / plain of one repeat): the sides of a pair
    run back to back, alternating which goes first, so a pair's ratio cancels the machine's
    drift between pairs; a ratio of the two sides' separate medians may pair a fast repeat's
    plain side with a slow repeat's hpsearch side."""
    return statistics.median(pair_ratios) if pair_ratios else None


def compare_work(plain: Side, hps: Side) -> dict[str, Any]:
    """Did both sides do the same work (same params, same states)? Exact only with 1 worker."""
    a = {t["number"]: t for t in plain.trials}
    b = {t["number"]: t for t in hps.trials}
    common = sorted(set(a) & set(b))

    def same_params(p: dict[str, Any], q: dict[str, Any]) -> bool:
        if set(p) != set(q):
            return False
        for k, v in p.items():
            w = q[k]
            if isinstance(v, float) and isinstance(w, float):
                if not math.isclose(v, w, rel_tol=1e-9, abs_tol=1e-12):
                    return False
            elif v != w:
                return False
        return True

    params = sum(same_params(a[n]["params"], b[n]["params"]) for n in common)
    states = sum(a[n]["state"] == b[n]["state"] for n in common)
    diffs = [
        abs(a[n]["value"] - b[n]["value"])
        for n in common
        if isinstance(a[n]["value"], float) and isinstance(b[n]["value"], float)
    ]
    epochs = (
        sum(t["epochs_reported"] for t in plain.trials),
        sum(t["epochs_reported"] for t in hps.trials),
    )
    return {
        "trials_compared": len(common),
        "same_params": params,
        "same_state": states,
        "max_value_diff": max(diffs) if diffs else None,
        "epochs_reported": {"plain": epochs[0], "hpsearch": epochs[1]},
    }


def like_for_like(runs: list[dict[str, Any]], workers: int = 1) -> str | None:
    """None when every repeat's sides did the same work; else why their wall times do not
    compare. One worker: the same trials in the same states, trial by trial. Several: the
    order of the trials differs between the sides, so the counts of each state are compared."""
    for r in runs:
        plain, hps = r["plain"]["trials"], r["hpsearch"]["trials"]
        if workers > 1:
            counts = [
                {s: sum(t["state"] == s for t in side) for s in ("complete", "pruned", "fail")}
                for side in (plain, hps)
            ]
            if counts[0] != counts[1]:
                return (
                    f"repeat {r['repeat'] + 1}: the sides' trial states differ "
                    f"(plain {counts[0]}, hpsearch {counts[1]})"
                )
            continue
        same = r["same_work"]
        n = max(len(plain), len(hps))
        if same["trials_compared"] != n or same["same_state"] != n:
            return (
                f"repeat {r['repeat'] + 1}: the sides' trial states differ "
                f"({same['same_state']}/{n} alike)"
            )
    return None


def verdict(ratio: float | None, unlike: str | None) -> str:
    if unlike is not None:
        return f"none: not like for like, {unlike}"
    return "n/a" if ratio is None else ("met" if ratio <= TARGET_RATIO else "MISSED")


def print_table(
    stats: dict[str, dict[str, Any]], ratio: float | None, unlike: str | None = None
) -> None:
    p, h = stats["plain"], stats["hpsearch"]

    def row(label: str, pv: str, hv: str, extra: str = "") -> None:
        print(f"{label:<28} {pv:>17} {hv:>17}  {extra}")

    def timed(label: str, key: str) -> None:
        pv, hv = p[key], h[key]
        extra = f"{hv / pv:.3f}x" if pv and hv is not None else ""
        row(label, fmt(pv), fmt(hv), extra)

    def counts(c: dict[str, int]) -> str:
        return f"{c.get('complete', 0)}/{c.get('pruned', 0)}/{c.get('fail', 0)}"

    head = f"{'':<28} {'plain':>17} {'hpsearch':>17}  hpsearch/plain (latencies: n)"
    print(head)
    print("-" * len(head))
    timed("wall s (spawn -> exit)", "wall_s")
    row("  launcher ready s", "-", fmt(h["ready_s"]))
    timed("  start-up s (-> 1st ask)", "startup_s")
    timed("  trial loop s", "loop_s")
    timed("  shut-down s (last tell ->)", "shutdown_s")
    row("trials complete/pruned/fail", counts(p["counts"]), counts(h["counts"]))
    row("between trials s p50/p99", pair(p["gap_s"], 2), pair(h["gap_s"], 2))
    for key, label in LATENCIES:
        digits = 2 if key.endswith("_s") else 1
        pl, hl = p["latency"][key], h["latency"][key]
        # n values each: under 100, the p99 lies between the two largest (common.percentile)
        n = f"n {pl['n'] if pl else 0} / {hl['n'] if hl else 0}"
        row(f"{label} p50/p99", pair(pl, digits), pair(hl, digits), n)
    roles = sorted(set(p["cpu_s"]) | set(h["cpu_s"]))
    for role in roles:
        row(f"CPU s: {role}", fmt(p["cpu_s"].get(role)), fmt(h["cpu_s"].get(role)))
    if roles:
        # every role: the sampler counts only the bench's own processes (common.CpuSampler)
        tp, th = (sum(v or 0 for v in s["cpu_s"].values()) for s in (p, h))
        row("CPU s: both sides", fmt(tp), fmt(th), f"{th / tp:.3f}x" if tp else "")
    print(
        f"wall-time ratio hpsearch/plain: {fmt(ratio, 3)} "
        f"(target <= {TARGET_RATIO}: {verdict(ratio, unlike)})"
    )


def host_info(args: argparse.Namespace, warm: dict[str, Any]) -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "omp_num_threads_plain": plain_env(args.workers, str(warm.get("device"))).get(
            "OMP_NUM_THREADS"
        ),
        "torch": warm.get("torch"),
        "torchvision": warm.get("torchvision"),
        "torch_threads": warm.get("torch_threads"),
        "device": warm.get("device"),
        "cuda_device": warm.get("cuda_device"),
        "optuna": version("optuna"),
        "mlflow": version("mlflow"),
        "sqlalchemy": version("sqlalchemy"),
        "psycopg2": version("psycopg2-binary") or version("psycopg2"),
        "hpsearch": version("hpsearch"),
        "postgresql": pg_version(args.pg),
    }


# --------------------------------------------------------------------------- main


def bench(args: argparse.Namespace) -> int:
    from hpsearch.config import find_study_file, load_config
    from hpsearch.errors import HpsearchError
    from hpsearch.tracking.server import start_local_server

    try:
        study_file = str(find_study_file(args.study).resolve())
        base_cfg = load_config(study_file, args.overrides, data_dir=args.data_dir)
        n_trials = args.trials or base_cfg.budget.n_trials
        epochs = args.epochs or base_cfg.budget.max_epochs
        overrides = side_overrides(args, n_trials, epochs)
        cfg = load_config(study_file, overrides, data_dir=args.data_dir)
    except HpsearchError as exc:
        raise BenchError(str(exc)) from exc
    check_output_path(args.json_path)
    if not Path(args.data_dir).is_dir():
        raise BenchError(f"--data-dir: {args.data_dir}: no such folder (it holds flowers-102/)")
    pg_version(args.pg)  # fail fast, before anything is started
    cache_workdir = Path(args.cache_workdir).resolve()
    root = Path(tempfile.mkdtemp(prefix="hpsearch-bench-overhead-"))
    ctx: dict[str, Any] = {
        "study_file": study_file,
        "study_name": cfg.name,
        "overrides": overrides,
        "n_trials": n_trials,
        "cache_workdir": cache_workdir,
    }
    print(
        f"study {cfg.name} ({study_file}): {n_trials} trials x {epochs} epochs, "
        f"{args.workers} worker(s), device {args.device}, sampler {cfg.sampler.name} "
        f"seed {cfg.sampler.seed}, pruner {cfg.pruner.name}; work folder {root}",
        flush=True,
    )
    databases: list[str] = []
    server = None
    runs: list[dict[str, Any]] = []
    results: dict[str, list[Side]] = {s: [] for s in SIDES}
    try:
        t = time.perf_counter()
        warm = run_child(
            {
                "mode": "warmup",
                "study_file": study_file,
                "overrides": overrides,
                "data_dir": args.data_dir,
                "device": args.device,
                "workdir": str(cache_workdir),
            },
            root,
            "warmup",
            plain_env(args.workers, args.device),
        )
        warm["wall_s"] = time.perf_counter() - t
        ctx["device"] = str(warm["device"])  # resolved: "auto" is "cpu" or "cuda..." here
        print(
            f"warm-up (untimed): {warm['caches_built']} cache file(s) built, cache "
            f"{warm['cache_s']:.1f}s, {warm['wall_s']:.1f}s in all; device {warm['device']}",
            flush=True,
        )
        server = start_local_server(root / "mlflow-server")
        ctx["tracking_uri"] = server.url
        print(f"mlflow server {server.url} healthy after {server.started_s:.1f}s", flush=True)
        first = 0 if args.order == "plain-first" else 1
        for rep in range(args.repeats):
            order = SIDES if (first + rep) % 2 == 0 else SIDES[::-1]
            pair_: dict[str, Side] = {}
            for side in order:
                name = f"{DB_PREFIX}_{os.getpid()}_{side}{rep}"
                url = create_database(args.pg, name)
                databases.append(name)
                init_schema(url)
                print(f"[{rep + 1}/{args.repeats}] {side}: running ...", flush=True)
                run = run_plain if side == "plain" else run_hpsearch
                pair_[side] = run(args, ctx, url, root, rep)
                results[side].append(pair_[side])
                print(
                    f"[{rep + 1}/{args.repeats}] {side}: {pair_[side].wall_s:.1f}s "
                    f"{pair_[side].counts}",
                    flush=True,
                )
                if not args.keep:
                    drop_database(args.pg, name)
                    databases.remove(name)
            runs.append(
                {
                    "repeat": rep,
                    "order": list(order),
                    "ratio": pair_["hpsearch"].wall_s / pair_["plain"].wall_s,
                    "same_work": compare_work(pair_["plain"], pair_["hpsearch"]),
                    "plain": asdict(pair_["plain"]),
                    "hpsearch": asdict(pair_["hpsearch"]),
                }
            )
            if args.json_path:  # the pairs so far, replaced by the full report at the end
                partial = {"partial": True, "args": vars(args), "runs": runs}
                Path(args.json_path).write_text(json.dumps(jsonable(partial), indent=2))
        server_start_s = server.started_s
    finally:
        if server is not None:
            server.stop()
        for name in databases if not args.keep else []:
            with contextlib.suppress(Exception):
                drop_database(args.pg, name)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    stats = {s: side_stats(results[s]) for s in SIDES}
    pw, hw = stats["plain"]["wall_s"], stats["hpsearch"]["wall_s"]
    ratio = headline_ratio([r["ratio"] for r in runs])
    ratio_of_medians = hw / pw if pw and hw is not None else None
    print()
    print(
        f"{cfg.name}: {n_trials} trials x {epochs} epochs, {args.workers} worker(s) per side, "
        f"{args.repeats} repeat(s) (medians; latencies pooled; the ratio: the median of the "
        "per-repeat ratios)"
    )
    unlike = like_for_like(runs, args.workers)
    print_table(stats, ratio, unlike)
    if args.repeats > 1:
        print("per-repeat ratios: " + ", ".join(f"{r['ratio']:.3f}" for r in runs))
        print(f"ratio of the sides' median wall times: {fmt(ratio_of_medians, 3)}")
    if pw and hw is not None:
        print(
            f"wall-time difference per trial: {(hw - pw) / n_trials:+.2f}s (fixed costs included)"
        )
    same = runs[0]["same_work"]
    print(
        f"same work (repeat 1): params equal in {same['same_params']}/{same['trials_compared']} "
        f"trials, states in {same['same_state']}; epochs reported plain "
        f"{same['epochs_reported']['plain']} vs hpsearch {same['epochs_reported']['hpsearch']}"
        + ("" if args.workers == 1 else " (several workers: order differs, not expected equal)")
    )
    if not stats["hpsearch"]["timings_found"]:
        print("hpsearch latencies: n/a (the worker wrote no <workdir>/timings/*.jsonl)")
    if args.keep:
        print(f"kept: {root} and databases {', '.join(databases) or '-'}")
    if args.json_path:
        report = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "args": vars(args),
            "host": host_info(args, warm),
            "study": {
                "name": cfg.name,
                "file": study_file,
                "overrides": overrides,
                "trials": n_trials,
                "epochs": epochs,
                "workers": args.workers,
                "sampler": cfg.sampler.model_dump(),
                "pruner": cfg.pruner.model_dump(),
            },
            "plain_loop": "optuna ask/tell + hpsearch.study.suggest + hpsearch.trainer.train; "
            "no MLflow" + ("; per-epoch checkpoints" if args.plain_checkpoint else ""),
            "warmup": warm,
            "mlflow_server_start_s": server_start_s,
            "target_ratio": TARGET_RATIO,
            "ratio": ratio,  # the median of runs[*].ratio
            "ratio_of_medians": ratio_of_medians,
            # None when the sides did different work: their wall times do not compare
            "target_met": None if unlike else ratio is not None and ratio <= TARGET_RATIO,
            "not_like_for_like": unlike,
            "summary": stats,
            "runs": runs,
        }
        Path(args.json_path).write_text(json.dumps(jsonable(report), indent=2))
        print(f"JSON: {args.json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)  # the parent stops its children (their own sessions)
    # SIGTERM (`timeout ... overhead.py`) as Ctrl-C, once (common.run_main): KeyboardInterrupt
    # unwinds `bench`, whose handlers stop the launch or plain loops and whose `finally` stops
    # the MLflow server, drops the databases and removes the temp folder.
    return run_main("overhead.py", lambda: bench(args))


if __name__ == "__main__":
    sys.exit(main())
