"""Storage throughput: many workers asking, reporting and telling on PostgreSQL at once.

Each worker process runs trials of a dummy trainer (no training: it reports `--epochs`
values at once) for `--seconds`, against a fresh database. Two modes, same study, same
sampler and pruner, same work per trial (ask, suggest the study's params, report + should_prune
per epoch but no should_prune at the last, as hpsearch's worker, tell):

  plain     a hand-written Optuna ask/tell loop per process on RDBStorage (the baseline)
  hpsearch  hpsearch's worker loop (`run_worker`): exact trial budget, heartbeats, stale-trial
            recovery, per-trial attributes; MLflow off, since this measures the storage

Worker i of either mode draws from seed stream i of the study's sampler seed, as `hpsearch
launch` numbers its workers (hpsearch.study.sampler_seed): workers sharing one seed would
propose the same parameters, and the median pruner would then prune fewer trials, so that a
mode's trials made more report round trips. The table gives the reports per second and the
pruned share beside trials/s, so that two modes' trials/s compare the same work. Failed
trials (errors) are not counted in trials/s; trials/s with them is in the JSON
(`trials_per_s_all`). A worker process that crashes ends the bench's run at once with exit
code 1.

Example:
    python bench/storage.py --workers 1 8 32 --seconds 15 --json /tmp/bench-storage.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
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

from common import (  # noqa: E402
    BenchError,
    check_output_path,
    create_database,
    drop_database,
    nonnegative_float,
    percentile,
    pg_version,
    positive_float,
    positive_int,
    run_main,
)
from hpsearch.config import load_config  # noqa: E402
from hpsearch.storage import StorageSpec, normalize_url  # noqa: E402
from hpsearch.study import create_or_load, make_pruner, make_sampler, suggest  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=positive_int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seconds", type=positive_float, default=15.0, help="asking time per run")
    p.add_argument("--epochs", type=positive_int, default=3, help="reports per trial")
    p.add_argument(
        "--epoch-s",
        type=nonnegative_float,
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
# report() calls of this (forked) worker process's dummy trials: its report round trips
_REPORTS = [0]


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
        _REPORTS[0] += 1
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


def _leave_stops_to_the_bench() -> None:
    """A forked worker ignores Ctrl-C (the terminal sends it to the whole group) and takes
    SIGTERM's default: the bench, which gets them too, kills its workers, then drops the
    database and the temp folder; a worker's own KeyboardInterrupt would only print a
    traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _plain_worker(
    url: str, cfg: Any, stream: int, start_at: float, seconds: float, out: Any
) -> None:
    _leave_stops_to_the_bench()
    lat: dict[str, list[float]] = {"ask": [], "report": [], "tell": []}
    began = [time.monotonic()]  # from the start barrier once there, as the hpsearch side
    n = 0
    try:
        n = _plain_loop(url, cfg, stream, start_at, seconds, lat, began)
        crash = None
    except Exception as exc:  # reported at once to the bench, not left to its queue timeout
        crash = f"{type(exc).__name__}: {exc}"
        print(f"plain worker {os.getpid()}: {crash}", file=sys.stderr, flush=True)
    out.put({"trials": n, "ok": n, "elapsed": time.monotonic() - began[0], "lat": lat,
             "reports": len(lat["report"]), "errors": int(crash is not None),
             "crash": crash})  # fmt: skip


def _plain_loop(
    url: str,
    cfg: Any,
    stream: int,
    start_at: float,
    seconds: float,
    lat: dict[str, list[float]],
    began: list[float],
) -> int:
    """Trials until `seconds` after `start_at`; latencies (s) appended to `lat`, and the
    time the trials began (after the start barrier) set in `began[0]`: the connection and
    the wait for the other workers count on neither side (the hpsearch side's elapsed
    starts at the barrier too, and includes its own connection)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(url)
    study = optuna.load_study(
        study_name=cfg.name,
        storage=storage,
        # Worker `stream`'s seed, as hpsearch's launcher gives its worker i (a shared seed
        # would have every worker propose the same parameters).
        sampler=make_sampler(cfg, stream),
        pruner=make_pruner(cfg),
    )
    epoch_s = float(os.environ.get(EPOCH_S_ENV, "0"))
    time.sleep(max(0.0, start_at - time.time()))
    began[0] = time.monotonic()
    t_end = began[0] + seconds
    n = 0
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
            prune = not last_epoch(epoch, cfg) and trial.should_prune()
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
    return n


def last_epoch(epoch: int, cfg: Any) -> bool:
    """The last epoch's value is recorded but not judged, as hpsearch's worker does
    (search/reporting.py `TrialReports`, `last_step`): both modes then prune alike and make
    the same round trips per trial."""
    return epoch >= cfg.budget.max_epochs


def _hpsearch_worker(
    url: str, cfg: Any, stream: int, start_at: float, seconds: float, workdir: str, out: Any
) -> None:
    from hpsearch.worker import STALE, WorkerOptions, run_worker

    _leave_stops_to_the_bench()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    opts = WorkerOptions(
        workdir=Path(workdir),
        worker_id=f"bench-{os.getpid()}",
        device="cpu",
        timeout_s=seconds,
        train_fn="__main__:dummy_train",
        max_errors=1000,
        sampler_stream=stream,  # as `hpsearch launch` numbers its workers
    )
    spec = StorageSpec(kind="rdb", url=url, display=url)
    time.sleep(max(0.0, start_at - time.time()))
    began = time.monotonic()
    errors, crash = 0, None
    try:
        summary = run_worker(cfg, spec, opts)
        n = len(summary.trials)
        # failed trials ("error") and any handed back unfinished ("interrupted")
        errors = summary.outcomes.get("error", 0)
        ok = n - errors - summary.outcomes.get("interrupted", 0) - summary.outcomes.get(STALE, 0)
    except Exception as exc:  # reported at once to the bench, which ends the run
        crash = f"{type(exc).__name__}: {exc}"
        print(f"hpsearch worker {os.getpid()}: {crash}", file=sys.stderr, flush=True)
        n, ok, errors = 0, 0, 1
    out.put({"trials": n, "ok": ok, "elapsed": time.monotonic() - began, "lat": None,
             "reports": _REPORTS[0], "errors": errors, "crash": crash})  # fmt: skip


# --- one run ------------------------------------------------------------------------------


class WorkerCrash(Exception):
    """A worker process died or raised: the run's figures would be wrong."""


def collect(procs: list[Any], out: Any, limit_s: float) -> list[dict[str, Any]]:
    """Every worker's result from `out`, or WorkerCrash as soon as one worker reports a crash
    or exits without a result (killed, or an error outside its try)."""
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + limit_s
    while len(results) < len(procs):
        try:
            r = out.get(timeout=1.0)  # s: how soon a dead worker is noticed
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise WorkerCrash(
                    f"worker pid {dead[0].pid} exited with code {dead[0].exitcode} without a result"
                ) from None
            if time.monotonic() > deadline:
                raise WorkerCrash(f"no result from {len(procs) - len(results)} "
                                  f"worker(s) after {limit_s:g} s") from None  # fmt: skip
            continue
        if r.get("crash"):
            raise WorkerCrash(f"a worker crashed: {r['crash']}")
        results.append(r)
    return results


def run_one(args: argparse.Namespace, mode: str, workers: int) -> dict[str, Any]:
    cfg = study_config(args)
    db = f"hpsearch_bench_storage_{os.getpid()}"
    engine = None
    try:  # from the CREATE on: a stop in between still drops the database
        url = normalize_url(create_database(args.pg, db))
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        create_or_load(cfg, optuna.storages.RDBStorage(url))  # schema + study, untimed
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        start_at = time.time() + 2.0 + 0.05 * workers  # all processes begin together
        with tempfile.TemporaryDirectory() as workdir:
            procs = []
            for i in range(workers):  # worker i: seed stream i, in both modes
                if mode == "plain":
                    a: tuple[Any, ...] = (url, cfg, i, start_at, args.seconds, out)
                    procs.append(ctx.Process(target=_plain_worker, args=a))
                else:
                    a = (url, cfg, i, start_at, args.seconds, workdir, out)
                    procs.append(ctx.Process(target=_hpsearch_worker, args=a))
            for p in procs:
                p.start()
            collected = False
            try:
                # s: the start barrier, the run, then the last trials and the shut-down
                results = collect(procs, out, start_at - time.time() + args.seconds + 300)
                collected = True
            finally:
                for p in procs:
                    if not collected:  # a crash or Ctrl-C: the others' figures are moot
                        p.kill()
                    p.join(timeout=60)
                    if p.is_alive():
                        p.kill()
                        p.join(timeout=10)
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
        if engine is not None:
            engine.dispose()
        drop_database(args.pg, db)
    return make_row(mode, workers, results, lat, {str(k): int(v) for k, v in states.items()})


def make_row(
    mode: str,
    workers: int,
    results: list[dict[str, Any]],
    lat: dict[str, list[float]],
    states: dict[str, int],
) -> dict[str, Any]:
    """One mode's figures from its workers' results, latencies (ms) and the trials' states."""

    def rate(key: str) -> float:  # per s: each worker's count over its own run time, summed
        return sum(r[key] / r["elapsed"] for r in results if r["elapsed"] > 0)

    ok = sum(r["ok"] for r in results)
    reports = sum(r["reports"] for r in results)
    finished = states.get("COMPLETE", 0) + states.get("PRUNED", 0)
    row: dict[str, Any] = {
        "mode": mode,
        "workers": workers,
        "trials": ok,  # finished (complete or pruned) trials; failed ones are errors
        "trials_per_s": rate("ok"),
        "trials_all": sum(r["trials"] for r in results),  # errors included
        "trials_per_s_all": rate("trials"),
        "errors": sum(r["errors"] for r in results),
        "states": states,
        # the work per trial: report + should_prune round trips, fewer as more are pruned
        "reports": reports,
        "reports_per_s": rate("reports"),
        "reports_per_trial": reports / ok if ok else None,
        "pruned_share": states.get("PRUNED", 0) / finished if finished else None,
    }
    for k, v in lat.items():
        row[f"{k}_n"] = len(v)  # under 100 values, the p99 lies between the two largest
        row[f"{k}_p50_ms"] = percentile(v, 50) if v else None
        row[f"{k}_p99_ms"] = percentile(v, 99) if v else None
    return row


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C or SIGTERM (`timeout`): KeyboardInterrupt unwinds run_one, whose `finally`
    # blocks kill the workers, remove the temp folder and drop the database.
    return run_main("storage.py", lambda: bench(args))


def study_config(args: argparse.Namespace) -> Any:
    """The study with the bench's budget: every trial `--epochs` reports, no trial cap."""
    return load_config(
        args.study, overrides=[f"budget.max_epochs={args.epochs}", "budget.n_trials=1000000"]
    )


def bench(args: argparse.Namespace) -> int:
    check_output_path(args.json)
    if bad := [m for m in args.modes if m not in ("plain", "hpsearch")]:
        raise BenchError(f"--modes: {bad[0]!r}: must be plain or hpsearch")
    if not args.pg.startswith(("postgresql://", "postgres://")):
        raise BenchError(f"--pg: {args.pg!r}: expected postgresql://user@host:port")
    study_config(args)  # a bad study or override: said before any database is made
    pg_version(args.pg)  # an unreachable server likewise
    os.environ[EPOCH_S_ENV] = str(args.epoch_s)
    rows: list[dict[str, Any]] = []
    for workers in args.workers:
        for mode in args.modes:
            try:
                row = run_one(args, mode, workers)
            except WorkerCrash as exc:
                print(f"{mode} with {workers} workers: {exc}", file=sys.stderr)
                _write_json(args, rows, f"{mode} with {workers} workers: {exc}")
                return 1
            rows.append(row)
            _write_json(args, rows)  # after each row: a later crash keeps these
            print(
                f"{mode:9} {workers:3} workers: {row['trials_per_s']:6.1f} trials/s "
                f"({row['trials']} trials, {row['errors']} errors, "
                f"{row['reports_per_s']:.1f} reports/s, pruned {_fmt(row['pruned_share'], '.2f')})",
                flush=True,
            )
    print()
    print("| mode | workers | trials/s | errors | reports/s | reports/trial | pruned share "
          "| ask p50/p99 ms | report p50/p99 ms | tell p50/p99 ms |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['mode']} | {r['workers']} | {r['trials_per_s']:.1f} | {r['errors']} | "
            f"{r['reports_per_s']:.1f} | {_fmt(r['reports_per_trial'], '.2f')} | "
            f"{_fmt(r['pruned_share'], '.2f')} | "
            f"{_fmt(r['ask_p50_ms'])} / {_fmt(r['ask_p99_ms'])} | "
            f"{_fmt(r['report_p50_ms'])} / {_fmt(r['report_p99_ms'])} | "
            f"{_fmt(r['tell_p50_ms'])} / {_fmt(r['tell_p99_ms'])} |"
        )
    if any(r["errors"] for r in rows):
        print("errors: failed trials, not counted in trials/s (with them: trials_per_s_all "
              "in the JSON)")  # fmt: skip
    print("report ms: on the training thread. Plain Optuna's is the report and pruning "
          "decision's round trips; hpsearch's is the hand-off and the decision (the write "
          "happens on a background thread).")  # fmt: skip
    return 0


def _write_json(args: Any, rows: list[dict[str, Any]], error: str | None = None) -> None:
    if not args.json:
        return
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
        # report_*_ms: the training thread's cost (see the table's note)
        "rows": rows,
        "error": error,
    }
    Path(args.json).write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    sys.exit(main())
