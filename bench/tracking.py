"""Benchmark of the per-trial MLflow tracking against a real ``mlflow server`` subprocess.

A dummy "trainer" runs ``--trials`` trials of ``--epochs`` epochs, each epoch busy for
``--epoch-ms`` ms on the training thread, in three modes:

* ``none``  - no tracking (baseline wall time);
* ``queue`` - :class:`hpsearch.tracking.mlflow_logger.TrialTracker` (enqueue on the training
  thread, one ``log_batch`` per epoch from a background thread);
* ``sync``  - a plain ``MlflowClient.log_batch`` on the training thread every epoch (what the
  queue saves the training loop).

Reported: cost per epoch on the training thread (enqueue / synchronous call), end-to-end
delivery latency (enqueue -> ``log_batch`` returned), wall-time overhead per epoch versus the
baseline, trial start (``create_run``) and finish costs, the server's start time. Target: < 50 ms
per epoch report on the training thread.

    python bench/tracking.py --trials 3 --epochs 40 --epoch-ms 20 --json bench-tracking.json
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    check_output_path,
    nonnegative_float,
    percentile,
    positive_int,
    run_main,
    write_json,
)
from hpsearch.tracking.mlflow_logger import (
    TrialTracker,
    apply_http_policy,
    ensure_experiment,
    open_study_run,
    trial_params,
)
from hpsearch.tracking.server import start_local_server
from mlflow import MlflowClient
from mlflow.entities import Metric

METRICS = (
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "lr",
    "epoch_seconds",
    "images_per_second",
)


def busy(ms: float) -> None:
    """Burn CPU for ``ms`` ms (a training step that holds the GIL, worst case for threads)."""
    end = time.perf_counter() + ms / 1000.0
    x = 0
    while time.perf_counter() < end:
        x += 1


def epoch_metrics(e: int) -> dict[str, float]:
    return {k: 1.0 / (e + 1) + i for i, k in enumerate(METRICS)}


def pct(values: list[float], q: float) -> float:
    """p50 the median, others linear between ranks (common.percentile); NaN when empty."""
    return percentile(values, q)


def summary_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    return {
        "n": len(ms),
        "mean": statistics.fmean(ms) if ms else float("nan"),
        "p50": pct(ms, 50),
        "p99": pct(ms, 99),
        "max": max(ms) if ms else float("nan"),
    }


def run_mode(
    mode: str, client: MlflowClient, exp: str, parent: str, args: argparse.Namespace
) -> dict[str, Any]:
    per_epoch: list[float] = []
    latency: list[float] = []
    starts: list[float] = []
    finishes: list[float] = []
    requests = 0
    t_all = time.perf_counter()
    for trial in range(args.trials):
        tracker: TrialTracker | None = None
        run_id: str | None = None
        t0 = time.perf_counter()
        if mode == "queue":
            tracker = TrialTracker(
                client,
                exp,
                parent,
                trial_number=trial,
                study_name="bench",
                params=trial_params({"lr": 0.1, "batch_size": 128}, arch="resnet18"),
                worker="bench",
            )
        elif mode == "sync":
            run_id = client.create_run(exp, run_name=f"sync-{trial}").info.run_id
        starts.append(time.perf_counter() - t0)
        for e in range(args.epochs):
            busy(args.epoch_ms)
            t1 = time.perf_counter()
            if tracker is not None:
                tracker.log_epoch(e, epoch_metrics(e))
            elif run_id is not None:
                now = int(time.time() * 1000)
                client.log_batch(
                    run_id,
                    metrics=[Metric(k, v, now, e) for k, v in epoch_metrics(e).items()],
                    synchronous=True,
                )
                requests += 1
            per_epoch.append(time.perf_counter() - t1)
        t2 = time.perf_counter()
        if tracker is not None:
            tracker.finish("completed", summary_metrics={"best_val_acc": 0.9, "test_acc": 0.88})
            latency += tracker.stats.delivery_latency_s
            requests += tracker.stats.requests
        elif run_id is not None:
            client.set_terminated(run_id, "FINISHED")
        finishes.append(time.perf_counter() - t2)
    wall = time.perf_counter() - t_all
    return {
        "mode": mode,
        "wall_s": wall,
        "epochs": args.trials * args.epochs,
        "training_thread_ms": summary_ms(per_epoch),
        "delivery_latency_ms": summary_ms(latency),
        "trial_start_ms": summary_ms(starts),
        "trial_finish_ms": summary_ms(finishes),
        "log_batch_requests": requests,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=positive_int, default=3)
    ap.add_argument("--epochs", type=positive_int, default=40)
    ap.add_argument("--epoch-ms", type=nonnegative_float, default=20.0, help="busy time per epoch")
    ap.add_argument("--workdir", type=Path, default=None, help="store (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the results here (default: none)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main("tracking.py", lambda: bench(args))


def bench(args: argparse.Namespace) -> int:
    check_output_path(args.json)  # before the server starts, not after the run
    logging.basicConfig(level=logging.WARNING)
    apply_http_policy()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        with start_local_server(workdir) as server:
            client = MlflowClient(tracking_uri=server.url)
            exp = ensure_experiment(client, f"bench-{int(time.time())}")
            parent = open_study_run(client, exp, "bench", {"hpsearch.sampler": "none"}, "")
            # warm-up: first requests pay for connection setup and server-side caches
            run_mode(
                "queue",
                client,
                exp,
                parent,
                argparse.Namespace(**{**vars(args), "trials": 1, "epochs": 3}),
            )
            results = [run_mode(m, client, exp, parent, args) for m in ("none", "queue", "sync")]
            server_start_s = server.started_s

    base = results[0]["wall_s"]
    for r in results:
        r["overhead_per_epoch_ms"] = (r["wall_s"] - base) * 1000.0 / r["epochs"]
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "machine": platform.platform(),
        "trials": args.trials,
        "epochs_per_trial": args.epochs,
        "epoch_busy_ms": args.epoch_ms,
        "server_start_s": server_start_s,
        "results": results,
        "target_training_thread_ms": 50.0,
        "target_met": results[1]["training_thread_ms"]["max"] < 50.0,
    }
    if args.json:
        write_json(args.json, report)

    print(
        f"mlflow server start: {server_start_s:.1f} s; {args.trials} trials x {args.epochs} "
        f"epochs x {args.epoch_ms:g} ms busy"
    )
    head = (
        f"{'mode':<6} {'train-thread ms/epoch (mean/p99/max)':>38} "
        f"{'delivery ms (p50/p99)':>22} {'overhead ms/epoch':>18} {'start ms':>9} "
        f"{'finish ms':>10} {'requests':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        t, d = r["training_thread_ms"], r["delivery_latency_ms"]
        print(
            f"{r['mode']:<6} {t['mean']:>14.3f} /{t['p99']:>9.3f} /{t['max']:>9.3f} "
            f"{d['p50']:>12.1f} /{d['p99']:>8.1f} {r['overhead_per_epoch_ms']:>18.2f} "
            f"{r['trial_start_ms']['mean']:>9.1f} {r['trial_finish_ms']['mean']:>10.1f} "
            f"{r['log_batch_requests']:>9d}"
        )
    print(
        f"target < 50 ms per epoch report on the training thread: "
        f"{'met' if report['target_met'] else 'MISSED'}"
    )
    if args.json:
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
