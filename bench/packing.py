"""Worker packing on one GPU: trials/hour and images/s of `hpsearch launch` with 1, 2 and 4
workers sharing the device, every trial training the same fixed configuration.

For each worker count W: a fresh work folder and journal, then the real CLI in a subprocess,
`hpsearch launch --workers W --gpus 0 --no-tracking --trials W*k` (`--device cpu` and no
`--gpus` on a CPU; W may be `auto`, the launcher's own choice, given as many trials as the
largest W), with the search space replaced by fixed values (`--set search_space={}`
and `--set trainer.defaults.<param>=<value>`), pruning and early stopping off, and E epochs per
trial. The decoded data cache is built once beforehand and shared by every run, so no run pays
the one-time decode. Per W:

  trials/h      completed trials / launch wall time x 3600 (worker start-up included: spread
                over W x k trials, so a larger W pays less of it per trial)
  window/h      completed trials / (the last trial's end - the first trial's start) x 3600:
                the rate while trials run, start-up left out on every side
  speedup       trials/h over W=1's ("-" when W=1 was not run)
  speedup win   window/h over W=1's (the issue's target is judged on this one: it does not
                reward spreading start-up over more trials); "-" when W=1 has no window
                (one trial per worker: --trials-per-worker 1)
  img/s e2e     training images of all trials / launch wall time
  img/s steady  W x the median per-epoch training images/s of a trial (epochs after the
                first): the throughput while all W workers train at once
  s/trial       mean trial duration, ask to tell
  warm trials/h W x 3600 / the mean duration of trials that were not their worker's first
                (the packed rate once start-up and first-trial warm-up are behind)
  1st trial s   launch start to the first trial's start (process start-up)
  GPU util %    mean NVML device utilization during the launch (hpsearch.tracking.gpu);
                n/a on a CPU

Fixed params: each searched parameter takes its value from --params, else from PINNED below
(whether or not the study still searches that value: every lease trains the same), else the
first choice / the (geometric) middle of the range; image_size is the study's
dataset.image_size.

Example (CPU, about 2.5 minutes on 2 cores; a cache_size below the study's searched image
sizes is refused at load, so the searched sizes are shrunk too):
    python bench/packing.py --device cpu --workers 1 2 4 --trials-per-worker 2 --epochs 4 \\
        --set dataset.image_size=32 --set dataset.cache_size=36 --set dataset.eval_limit=255 \\
        --set 'search_space.image_size={type: categorical, choices: [32]}' \\
        --set trainer.evaluate_test=false --json bench-packing.json

Example (GPU):
    python bench/packing.py --device cuda --workers 1 2 4 --epochs 10 --json bench-packing.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    BenchError,
    GpuWatch,
    check_output_path,
    default_data_dir,
    environment,
    fmt,
    launch_args,
    launched_workers,
    load_launched_study,
    load_study_config,
    parse_workers,
    positive_float,
    positive_int,
    raise_keyboard_interrupt,
    resolve_device,
    run_launch,
    seconds_since,
    share_cache,
    trial_timings,
    warm_cache,
    worker_deaths,
)
from hpsearch.config import CategoricalParam, StudyConfig
from hpsearch.errors import HpsearchError
from hpsearch.runner import fixed_params

# A plain, GPU-friendly configuration: every lease's packing figures train this one, whatever
# the study's search space has become since (flowers102 no longer searches crop_flip).
# image_size None: the study's dataset.image_size (so `--set dataset.image_size=32` shrinks
# every trial).
PINNED: dict[str, Any] = {
    "arch": "resnet18",
    "image_size": None,
    "optimizer": "sgd",
    "lr": 0.2,
    "momentum": 0.9,
    "batch_size": 128,
    "lr_scaling": "none",
    "weight_decay": 5e-4,
    "loss": "ce",
    "augment": "crop_flip",
    "augment_strength": 0.5,
    "cutmix_alpha": 0.0,
    "mixup_alpha": 0.0,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--study", default="flowers102", help="study name or YAML path")
    p.add_argument(
        "--workers", type=parse_workers, nargs="+", default=["1", "2", "4"], help="counts, or auto"
    )
    p.add_argument(
        "--trials-per-worker", type=positive_int, default=2, help="k: W*k trials per launch"
    )
    p.add_argument("--epochs", type=positive_int, default=5, help="epochs of every trial")
    p.add_argument(
        "--params",
        default=None,
        metavar="JSON",
        help='fixed params, e.g. \'{"arch": "resnet34", "batch_size": 64}\' (over the defaults)',
    )
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="study override, passed to every launch after the bench's own (repeatable)",
    )  # fmt: skip
    p.add_argument("--data-dir", default=default_data_dir(), help="holds flowers-102/")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--gpu", default="0", help="the GPU all workers share (CUDA/NVML index)")
    p.add_argument("--workdir", default=None, help="runs go in a new folder here (default: tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work folders")
    p.add_argument(
        "--launch-timeout",
        type=positive_float,
        default=None,
        metavar="SEC",
        help="stop a launch that runs longer (its trials count as they stand)",
    )
    p.add_argument(
        "--gpu-interval", type=positive_float, default=0.5, help="NVML sampling period, s"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show the launcher's output")
    p.add_argument("--json", dest="json_path", default=None, help="write results here")
    return p.parse_args(argv)


def pinned_values(cfg: StudyConfig, given: dict[str, Any]) -> dict[str, Any]:
    """One value for every searched parameter (plus any other given one)."""
    out: dict[str, Any] = {}
    for name, spec in cfg.search_space.items():
        if name in given:
            out[name] = given[name]
        elif name in PINNED:
            out[name] = PINNED[name]
        elif isinstance(spec, CategoricalParam):
            out[name] = spec.choices[0]
        else:
            mid = math.sqrt(spec.low * spec.high) if spec.log else (spec.low + spec.high) / 2
            out[name] = round(mid) if spec.type == "int" else mid
    out.update({k: v for k, v in given.items() if k not in out})
    return out


def bench_overrides(pinned: dict[str, Any], epochs: int) -> list[str]:
    """Every trial the same work: no search, no pruning, no early stop, E epochs."""
    sets = ["search_space={}", "enqueue_trials=[]"]
    sets += [f"trainer.defaults.{k}={json.dumps(v)}" for k, v in pinned.items()]
    sets += [
        "pruner.name=none",
        "pruner.options={}",
        "trainer.patience=null",
        # validation as the earlier leases' flowers102 did it: their figures stay comparable
        "trainer.eval_every=2",
        "trainer.eval_flip=false",
        "trainer.eval_scale=1.0",
        f"budget.max_epochs={epochs}",
        "budget.timeout_s=null",
        "budget.trial_timeout_s=null",
    ]
    return sets


def images_per_epoch(cfg: StudyConfig) -> int:
    """Training images one epoch sees: whole batches only (the trainer drops the rest)."""
    from hpsearch.trainer import data

    src = data.get_source(cfg, "train")
    n = len(src) if src is not None else 0
    bs = cfg.resolve_params({}).batch_size
    return min(bs, n) * max(1, n // bs)


def measure(
    args: argparse.Namespace,
    cfg: StudyConfig,
    sets: list[str],
    label: str,
    root: Path,
    device: str,
    per_epoch: int,
) -> dict[str, Any]:
    from optuna.trial import TrialState

    workdir = root / f"w{label}"
    share_cache(root / "shared", workdir)
    largest = max((int(w) for w in args.workers if w != "auto"), default=4)
    n_trials = (largest if label == "auto" else int(label)) * args.trials_per_worker
    # Every trial runs once, in one call, on the worker that asked it: no worker restarts
    # (--max-restarts 0) and no retries of a trial whose worker died (--max-retries 0, else
    # another worker would finish it, resumed, and the run would look whole).
    cli = launch_args(
        args.study, sets, data_dir=args.data_dir, workdir=workdir, device=device, gpu=args.gpu,
        workers=label, trials=n_trials, max_restarts=0, max_retries=0,
    )  # fmt: skip
    print(f"W={label}: {n_trials} trials x {args.epochs} epochs ...", flush=True)
    with GpuWatch(device, args.gpu, args.gpu_interval) as gpu:
        # Stopped (run.sh's cap, Ctrl-C): what this count finished is still read and kept.
        run = run_launch(cli, workdir / "launch.log", args.launch_timeout, echo=args.verbose,
                         keep_on_interrupt=True)  # fmt: skip
    ran, reason = launched_workers(run)
    workers = ran or (1 if label == "auto" else int(label))
    try:
        study = load_launched_study(cfg.name, workdir, run)
    except BenchError as exc:  # this count's row says why; the others' rows stand
        return {"workers_arg": label, "workers": workers, "launch_returncode": run.returncode,
                "trials_per_hour": 0.0, "error": str(exc),
                "interrupted": run.interrupted}  # fmt: skip
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    epochs = sum(len(t.user_attrs.get("history", [])) for t in trials)
    steady: list[float] = []
    rows: list[dict[str, Any]] = []
    for t in trials:
        ips = [float(r["images_per_second"]) for r in t.user_attrs.get("history", [])]
        if ips:
            steady.append(statistics.median(ips[1:] or ips))
        duration = (
            (t.datetime_complete - t.datetime_start).total_seconds()
            if t.datetime_complete and t.datetime_start
            else None
        )
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                "worker": t.user_attrs.get("worker"),
                "outcome": t.user_attrs.get("outcome"),
                "duration_s": duration,
                "start_s": seconds_since(run.started, t.datetime_start),
                "epochs": len(ips),
                "images_per_second": ips,
                "val_acc": t.value,
            }
        )
    durations = [r["duration_s"] for r in rows if r["duration_s"] is not None]
    firsts: dict[Any, int] = {}  # worker -> its first trial's number
    for r in sorted((r for r in rows if r["start_s"] is not None), key=lambda r: r["start_s"]):
        firsts.setdefault(r["worker"], r["number"])
    warm = [r["duration_s"] for r in rows
            if r["duration_s"] is not None and r["number"] not in firsts.values()]  # fmt: skip
    # training only: the images of each epoch over its training rate (val not included)
    train_s = [sum(per_epoch / x for x in r["images_per_second"] if x > 0) for r in rows]
    timings = trial_timings(workdir)
    starts = [r["start_s"] for r in rows if r["start_s"] is not None]
    result: dict[str, Any] = {
        "workers_arg": label,
        "workers": workers,
        "auto_reason": reason or None,
        "trials_asked": n_trials,
        "complete": len(done),
        "states": {s: sum(1 for t in trials if t.state.name == s) for s in _states(trials)},
        "launch_returncode": run.returncode,
        "bench_stops": run.stops,
        "wall_s": run.wall_s,
        "trials_per_hour": len(done) / run.wall_s * 3600.0,
        "trials_per_hour_window": window_trials_per_hour(rows),
        "epochs": epochs,
        "train_images": epochs * per_epoch,
        "images_per_second_e2e": epochs * per_epoch / run.wall_s,
        "images_per_second_steady": statistics.fmean(steady) * workers if steady else None,
        "trial_seconds_mean": statistics.fmean(durations) if durations else None,
        "warm_trial_seconds_mean": statistics.fmean(warm) if warm else None,
        "warm_trials_per_hour": workers * 3600.0 / statistics.fmean(warm) if warm else None,
        "train_seconds_mean": statistics.fmean(train_s) if train_s else None,
        "first_trial_start_s": min(starts) if starts else None,
        "gpu_utilization_mean": gpu.utilization,
        "gpu": gpu.summary,
        "timings": timings,
        "trials": rows,
    }
    failed = [t.number for t in trials if t.state == TrialState.FAIL]
    deaths = worker_deaths(run)
    result["failed_trials"] = failed
    result["worker_deaths"] = deaths
    result["interrupted"] = run.interrupted
    problems = ["the bench was stopped during this count"] if run.interrupted else []
    if run.returncode != 0 or len(done) < n_trials:
        problems.append(
            f"launch exit code {run.returncode}, {len(done)}/{n_trials} trials complete"
        )
    if failed:
        problems.append(f"trial {', '.join(map(str, failed))} failed")
    problems += deaths
    if problems:
        result["error"] = (
            f"{'; '.join(problems)}; last lines of its log (all of it: --keep, {run.log}):\n"
            f"{run.tail()}"
        )
    return result


def window_trials_per_hour(rows: list[dict[str, Any]]) -> float | None:
    """Completed trials per hour from the first trial's start to the last completed trial's
    end (`start_s`, `duration_s`: seconds from the launch's start); None under two trials,
    where the window would be one trial's own duration."""
    done = [r for r in rows if r["state"] == "COMPLETE" and r["duration_s"] is not None
            and r["start_s"] is not None]  # fmt: skip
    starts = [r["start_s"] for r in rows if r["start_s"] is not None]
    if len(done) < 2 or not starts:
        return None
    window = max(r["start_s"] + r["duration_s"] for r in done) - min(starts)
    return len(done) / window * 3600.0 if window > 0 else None


def speedups(results: list[dict[str, Any]], key: str) -> None:
    """`results[i]["speedup" | "speedup_window"]`: `key` over that of the W=1 row. None
    (shown "-") where W=1 was not run, its launch failed, or it has no such figure (with one
    trial per worker, W=1 has no window): another row is no baseline, and against itself it
    showed 1.00."""
    name = "speedup" if key == "trials_per_hour" else "speedup_window"
    one = [r for r in results if r["workers_arg"] == "1" and "complete" in r and r.get(key)]
    base = one[0][key] if one else None
    for r in results:
        r[name] = r[key] / base if base and "complete" in r and r.get(key) else None


def _states(trials: list[Any]) -> list[str]:
    return sorted({t.state.name for t in trials})


def print_table(cfg: StudyConfig, args: argparse.Namespace, env: dict[str, Any],
                pinned: dict[str, Any], results: list[dict[str, Any]]) -> None:  # fmt: skip
    where = env.get("gpu") or f"cpu ({env['cpu_count']} cores)"
    print(
        f"\n{cfg.name}: {args.trials_per_worker} trials per worker x {args.epochs} epochs on "
        f"{where}; params {json.dumps(pinned, separators=(',', ':'))}"
    )
    head = (
        f"{'workers':>7} {'trials':>6} {'wall s':>7} {'trials/h':>9} {'speedup':>7} "
        f"{'window/h':>9} {'speedup win':>11} {'img/s e2e':>10} {'img/s steady':>12} "
        f"{'s/trial':>8} {'1st trial s':>11} "
        f"{'GPU util %':>10} {'GPU mem MiB':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        label = r["workers_arg"] if r["workers_arg"] != "auto" else f"auto:{r['workers']}"
        if "complete" not in r:  # its launch made no study: the error follows the tables
            print(f"{r['workers_arg']:>7} (its launch made no study)")
            continue
        mem = r["gpu"].get("system/gpu_memory_peak_mib")
        print(
            f"{label:>7} {r['complete']:>6} {r['wall_s']:>7.1f} "
            f"{r['trials_per_hour']:>9.1f} {fmt(r['speedup'], '.2f', '-'):>7} "
            f"{fmt(r.get('trials_per_hour_window')):>9} "
            f"{fmt(r.get('speedup_window'), '.2f', '-'):>11} "
            f"{r['images_per_second_e2e']:>10.1f} {fmt(r['images_per_second_steady']):>12} "
            f"{fmt(r['trial_seconds_mean']):>8} {fmt(r['first_trial_start_s']):>11} "
            f"{fmt(r['gpu_utilization_mean']):>10} {fmt(mem, '.0f'):>11}"
        )
    # Where a trial's time went (means over trials, s): the trainer's set-up; training; the
    # rest of its epochs (validation, report, checkpoint hand-off, logging: the worker's
    # epochs_s minus training); the finish (test pass, best model's write); and the rest of
    # the trial (ask, tell, start-up outside the trainer); a packed trial's wait for GPU
    # memory (`--workers auto`'s admission) is its own column, not part of the rest. The bench
    # restarts no worker (--max-restarts 0) and retries no trial (--max-retries 0), and a run
    # with a failed trial or a dead worker is an error: every epoch in a trial's history ran in
    # its timed call.
    head = (
        f"{'workers':>7} {'warm s/trial':>12} {'warm trials/h':>13} {'setup':>6} {'train':>6} "
        f"{'epoch rest':>10} {'finish':>6} {'gpu wait':>8} {'other':>6}"
    )
    print("\n" + head)
    print("-" * len(head))
    for r in results:
        if "complete" not in r:
            continue
        t = r["timings"]
        label = r["workers_arg"] if r["workers_arg"] != "auto" else f"auto:{r['workers']}"
        train, epochs = r.get("train_seconds_mean"), t.get("epochs_s_mean")
        val = epochs - train if train is not None and epochs is not None else None
        wait = t.get("admission_wait_s_mean", 0.0)
        parts = [t.get("setup_s_mean"), t.get("epochs_s_mean"), t.get("finish_s_mean"), wait]
        other = (
            t["trial_s_mean"] - sum(p for p in parts if p is not None)
            if "trial_s_mean" in t and None not in parts
            else None
        )
        print(
            f"{label:>7} {fmt(r.get('warm_trial_seconds_mean'), '.2f'):>12} "
            f"{fmt(r.get('warm_trials_per_hour')):>13} {fmt(t.get('setup_s_mean'), '.2f'):>6} "
            f"{fmt(train, '.2f'):>6} {fmt(val, '.2f'):>10} {fmt(t.get('finish_s_mean'), '.2f'):>6} "
            f"{fmt(wait, '.2f'):>8} {fmt(other, '.2f'):>6}"
        )
    for r in results:
        if r.get("auto_reason"):
            print(f"W=auto: {r['auto_reason']}")
        if "error" in r:
            print(f"W={r['workers_arg']}: {r['error']}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (run.sh's `timeout`) raises KeyboardInterrupt everywhere, the cache's warm-up and
    # the reading of a finished launch included: the rows so far stay in the JSON, and the
    # work folder is removed (run_launch's own handler covers only its launch).
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    try:
        check_output_path(args.json_path)  # before the work, not after it
        device = resolve_device(args.device)
        # no enqueued trial of the study's: every trial trains the pinned values
        base_cfg = load_study_config(args.study, ["enqueue_trials=[]", *args.overrides],
                                     args.data_dir)  # fmt: skip
        # the same parsing and checks as `hpsearch train --params`
        pinned = pinned_values(base_cfg, fixed_params(base_cfg, args.params, None, None, Path()))
        sets = bench_overrides(pinned, args.epochs) + list(args.overrides)
        cfg = load_study_config(args.study, sets, args.data_dir)
    except (BenchError, HpsearchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = environment(device, args.gpu)
    parent = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"packing-{time.strftime('%Y%m%d-%H%M%S')}-", dir=parent))
    record: dict[str, Any] = {
        "bench": "packing",
        "environment": env,
        "args": vars(args),
        "study": cfg.name,
        "params": pinned,
        "overrides": sets,
        "workdir": str(root) if args.keep else None,
        "results": [],
    }
    results: list[dict[str, Any]] = record["results"]
    try:
        record["cache_warm_s"] = warm_cache(cfg, root / "shared")
        record["images_per_epoch"] = per_epoch = images_per_epoch(cfg)
        print(f"data cache ready in {record['cache_warm_s']:.1f}s; {per_epoch} training images "
              "per epoch")  # fmt: skip
        for w in args.workers:
            results.append(measure(args, cfg, sets, w, root, device, per_epoch))
            speedups(results, "trials_per_hour")
            speedups(results, "trials_per_hour_window")
            r = results[-1]
            if args.json_path:  # after every run: a bench stopped later keeps what it has
                Path(args.json_path).write_text(json.dumps(record, indent=2, default=str))
            if r.get("interrupted"):
                raise KeyboardInterrupt
    except HpsearchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (`timeout`): the launch is already stopped
        print("interrupted: the launch and its workers were stopped", file=sys.stderr)
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_table(cfg, args, env, pinned, results)
    if args.json_path:
        print(f"JSON: {args.json_path}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
