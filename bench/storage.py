"""Storage throughput: many workers asking, reporting and telling on PostgreSQL at once.

Each worker process runs trials of a dummy trainer (no training: it reports `--epochs`
values at once) for `--seconds`, against a fresh database. Two modes, same study, same
sampler and pruner, same work per trial (ask, suggest the study's params, report + should_prune
per epoch, tell):

  plain     a hand-written Optuna ask/tell loop per process on RDBStorage (the baseline)
  hpsearch  hpsearch's worker loop (`run_worker`): exact trial budget, heartbeats, stale-trial
            recovery, per-trial attributes; MLflow off, since this measures the storage

Example:
    python bench/storage.py --workers 1 8 32 --seconds 15 --json /tmp/bench-storage.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy as sa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import create_database, drop_database, pg_version  # noqa: E402
from hpsearch.config import load_config  # noqa: E402
from hpsearch.storage import StorageSpec, normalize_url  # noqa: E402
from hpsearch.study import create_or_load, make_pruner, make_sampler, suggest  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seconds", type=float, default=15.0, help="asking time per run")
    p.add_argument("--epochs", type=int, default=3, help="reports per trial")
    p.add_argument(
        "--epoch-s",
        type=float,
        default=0.0,
        help="seconds of simulated training per epoch (a sleep), so that reads are not\n"
        "served from a cache refreshed a moment before (as with real epochs)",
    )
    p.add_argument("--modes", nargs="+", default=["plain", "hpsearch"])
    p.add_argument("--study", default="tiny", help="study file whose search space is sampled")
    p.add_argument(
        "--pg", default="postgresql://postgres@127.0.0.1:5432", help="server URL (no database)"
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


EPOCH_S_ENV = "HPSEARCH_BENCH_EPOCH_S"  # --epoch-s, read by the forked workers


# --- the dummy trainer (the hpsearch worker loads it as "__main__:dummy_train") ---------


def dummy_train(
    config: Any, params: Mapping[str, Any], report: Callable[[int, float], bool], options: Any
) -> Any:
    from hpsearch.trainer import TrialResult

    reason, pruned_at, acc = "finished", None, 0.0
    epoch_s = float(os.environ.get(EPOCH_S_ENV, "0"))
    for epoch in range(1, config.budget.max_epochs + 1):
        time.sleep(epoch_s)
        acc = min(1.0, float(params.get("lr", 0.1)) * epoch)
        if report(epoch, acc):
            reason, pruned_at = "pruned", epoch
            break
    return TrialResult(
        history=[], best_val_acc=acc, best_val_loss=1 - acc, final_val_acc=acc, test_acc=None,
        stop_reason=reason,
        epochs_run=pruned_at or config.budget.max_epochs, pruned_at_epoch=pruned_at,
        checkpoint_path=None, best_model_path=None, effective_lr=0.1, effective_batch_size=64,
        micro_batch_size=64, train_seconds=0.0, setup_seconds=0.0, confusion=None, message="",
        num_classes=2, class_names=["a", "b"],
    )  # fmt: skip


# --- one worker process of each mode ------------------------------------------------------


def _plain_worker(url: str, cfg: Any, start_at: float, seconds: float, out: Any) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(url)
    study = optuna.load_study(
        study_name=cfg.name, storage=storage, sampler=make_sampler(cfg), pruner=make_pruner(cfg)
    )
    lat: dict[str, list[float]] = {"ask": [], "report": [], "tell": []}
    epoch_s = float(os.environ.get(EPOCH_S_ENV, "0"))
    time.sleep(max(0.0, start_at - time.time()))
    t_end = time.monotonic() + seconds
    n = 0
    began = time.monotonic()
    while time.monotonic() < t_end:
        t0 = time.perf_counter()
        trial = study.ask()
        lat["ask"].append(time.perf_counter() - t0)
        params = suggest(trial, cfg)
        state, value = optuna.trial.TrialState.COMPLETE, 0.0
        for epoch in range(1, cfg.budget.max_epochs + 1):
            time.sleep(epoch_s)
            value = min(1.0, float(params.get("lr", 0.1)) * epoch)
            t0 = time.perf_counter()
            trial.report(value, epoch)
            prune = trial.should_prune()
            lat["report"].append(time.perf_counter() - t0)
            if prune:
                state = optuna.trial.TrialState.PRUNED
                break
        t0 = time.perf_counter()
        if state == optuna.trial.TrialState.PRUNED:
            study.tell(trial, state=state)
        else:
            study.tell(trial, value)
        lat["tell"].append(time.perf_counter() - t0)
        n += 1
    out.put({"trials": n, "elapsed": time.monotonic() - began, "lat": lat, "errors": 0})


def _hpsearch_worker(
    url: str, cfg: Any, start_at: float, seconds: float, workdir: str, out: Any
) -> None:
    from hpsearch.worker import WorkerOptions, run_worker

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    opts = WorkerOptions(
        workdir=Path(workdir),
        worker_id=f"bench-{os.getpid()}",
        device="cpu",
        timeout_s=seconds,
        train_fn="__main__:dummy_train",
        max_errors=1000,
    )
    spec = StorageSpec(kind="rdb", url=url, display=url)
    time.sleep(max(0.0, start_at - time.time()))
    began = time.monotonic()
    errors = 0
    try:
        summary = run_worker(cfg, spec, opts)
        n = len(summary.trials)
        errors = summary.outcomes.get("error", 0)
    except Exception as exc:  # a crashed worker is a result here, not a bench failure
        print(f"worker {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)
        n, errors = 0, 1
    out.put({"trials": n, "elapsed": time.monotonic() - began, "lat": None, "errors": errors})


# --- one run ------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_one(args: argparse.Namespace, mode: str, workers: int) -> dict[str, Any]:
    cfg = load_config(
        args.study,
        overrides=[f"budget.max_epochs={args.epochs}", "budget.n_trials=1000000"],
    )
    db = f"hpsearch_bench_storage_{os.getpid()}"
    url = normalize_url(create_database(args.pg, db))
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        create_or_load(cfg, optuna.storages.RDBStorage(url))  # schema + study, untimed
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        start_at = time.time() + 2.0 + 0.05 * workers  # all processes begin together
        with tempfile.TemporaryDirectory() as workdir:
            procs = []
            for _ in range(workers):
                if mode == "plain":
                    a: tuple[Any, ...] = (url, cfg, start_at, args.seconds, out)
                    procs.append(ctx.Process(target=_plain_worker, args=a))
                else:
                    a = (url, cfg, start_at, args.seconds, workdir, out)
                    procs.append(ctx.Process(target=_hpsearch_worker, args=a))
            for p in procs:
                p.start()
            results = [out.get(timeout=args.seconds + 300) for _ in procs]
            for p in procs:
                p.join(timeout=60)
            lat: dict[str, list[float]] = {"ask": [], "report": [], "tell": []}
            if mode == "plain":
                for r in results:
                    for k, v in r["lat"].items():
                        lat[k] += [x * 1e3 for x in v]
            else:
                for f in Path(workdir, "timings").glob("*.jsonl"):
                    for line in f.read_text().splitlines():
                        t = json.loads(line)
                        lat["ask"].append(t["ask_ms"])
                        lat["report"] += t["report_ms"]
                        lat["tell"].append(t["tell_ms"])
        with engine.connect() as conn:
            states: dict[str, int] = dict(
                conn.execute(
                    sa.text("SELECT state, count(*) FROM trials GROUP BY state")
                ).fetchall()
            )
    finally:
        engine.dispose()
        drop_database(args.pg, db)
    trials = sum(r["trials"] for r in results)
    rate = sum(r["trials"] / r["elapsed"] for r in results if r["elapsed"] > 0)
    row: dict[str, Any] = {
        "mode": mode,
        "workers": workers,
        "trials": trials,
        "trials_per_s": rate,
        "errors": sum(r["errors"] for r in results),
        "states": {str(k): int(v) for k, v in states.items()},
    }
    for k, v in lat.items():
        row[f"{k}_p50_ms"] = statistics.median(v) if v else None
        row[f"{k}_p99_ms"] = _pct(v, 0.99)
    return row


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.epoch_s < 0:
        print(f"--epoch-s: {args.epoch_s}: must be >= 0 (seconds per epoch)", file=sys.stderr)
        return 2
    os.environ[EPOCH_S_ENV] = str(args.epoch_s)
    rows = []
    for workers in args.workers:
        for mode in args.modes:
            if mode not in ("plain", "hpsearch"):
                print(f"--modes: {mode!r}: must be plain or hpsearch", file=sys.stderr)
                return 2
            row = run_one(args, mode, workers)
            rows.append(row)
            print(
                f"{mode:9} {workers:3} workers: {row['trials_per_s']:6.1f} trials/s "
                f"({row['trials']} trials, {row['errors']} errors)",
                flush=True,
            )
    print()
    print("| mode | workers | trials/s | ask p50/p99 ms | report p50/p99 ms | tell p50/p99 ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['mode']} | {r['workers']} | {r['trials_per_s']:.1f} | "
            f"{_fmt(r['ask_p50_ms'])} / {_fmt(r['ask_p99_ms'])} | "
            f"{_fmt(r['report_p50_ms'])} / {_fmt(r['report_p99_ms'])} | "
            f"{_fmt(r['tell_p50_ms'])} / {_fmt(r['tell_p99_ms'])} |"
        )
    if args.json:
        info = {
            "bench": "storage",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "optuna": optuna.__version__,
            "sqlalchemy": sa.__version__,
            "postgres": pg_version(args.pg),
            "args": vars(args),
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
