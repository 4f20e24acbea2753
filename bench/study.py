"""Time to accuracy: run a study with the real `hpsearch launch` for a fixed time budget and
report what it found in that time.

`hpsearch launch --study S --workers N --timeout SEC --no-tracking` runs in a subprocess on a
fresh work folder and journal (the decoded data cache is built beforehand unless --cold, so the
budget goes to training). Workers stop taking new trials at SEC; trials still running get
--grace more seconds to finish, then the bench stops the launch as Ctrl-C does (those trials
checkpoint at their next epoch and are re-queued: counted as interrupted). The budget is
--timeout: best value, times and finished trials count the trials completed by then (launch
start + SEC); those completed in the grace period are reported beside them. Reported:

  best value        the best trial completed within the budget (val_acc for flowers102); the
                    best with the grace period's completions too, where that differs
  test acc          that trial's `test_acc` attribute (trainer.evaluate_test), else its best
                    model evaluated on the test split by the bench
  time to best      launch start to the completion of the best trial
  time to X         launch start to the first completed trial reaching value X (--target)
  trials            complete, pruned, failed, interrupted (all, grace period included);
                    finished within the budget and in the grace period; epochs and images
                    trained (each epoch once: a retry counts the epochs it trained itself)
  GPU util %        mean NVML device utilization during the launch (hpsearch.tracking.gpu),
                    and from the first trial's start to the time-out (without start-up and
                    the stop); n/a on a CPU

Example (CPU, about 3 minutes on 2 cores; image_size is searched, so it is pinned here, and
the study's enqueued trial, at 128 px, is given at 32):
    python bench/study.py --device cpu --workers 2 --timeout 150 --grace 45 \\
        --set dataset.cache_size=36 --set dataset.eval_limit=255 --set budget.max_epochs=6 \\
        --set 'search_space.image_size={type: categorical, choices: [32]}' \\
        --set 'search_space.arch={type: categorical, choices: [resnet18]}' \\
        --set 'enqueue_trials=[{arch: resnet18, image_size: 32, batch_size: 256, lr: 0.1}]' \\
        --set pruner.options.min_resource=2 --target 0.05 0.1 --json bench-study.json

Example (GPU):
    python bench/study.py --device cuda --workers 4 --timeout 200 --target 0.3 0.5 \\
        --json bench-study.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shutil
import signal
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
    journal_path,
    launch_args,
    launched_workers,
    load_launched_study,
    load_study_config,
    nonnegative_float,
    parse_workers,
    positive_float,
    positive_int,
    raise_keyboard_interrupt,
    resolve_device,
    run_launch,
    seconds_since,
    trial_timings,
    warm_cache,
)
from hpsearch.config import StudyConfig
from hpsearch.errors import HpsearchError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--study", default="flowers102", help="study name or YAML path")
    p.add_argument(
        "--workers", type=parse_workers, default="1", help="worker processes (one GPU), or auto"
    )
    p.add_argument(
        "--timeout", type=positive_float, default=200.0, help="launch --timeout, seconds"
    )
    p.add_argument(
        "--grace",
        type=nonnegative_float,
        default=60.0,
        help="seconds after --timeout that running trials may take to finish",
    )
    p.add_argument(
        "--trials", type=positive_int, default=None, help="launch --trials (else the study's)"
    )
    p.add_argument(
        "--target",
        type=float,
        nargs="+",
        default=[],
        help="report when the best value first reached each of these",
    )
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="study override, passed to the launch (repeatable)",
    )  # fmt: skip
    p.add_argument("--data-dir", default=default_data_dir(), help="holds flowers-102/")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--gpu", default="0", help="the GPU the workers share (CUDA/NVML index)")
    p.add_argument("--workdir", default=None, help="the run goes in a new folder here")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--cold", action="store_true", help="do not build the data cache first")
    p.add_argument(
        "--gpu-interval", type=positive_float, default=1.0, help="NVML sampling period, s"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show the launcher's output")
    p.add_argument("--json", dest="json_path", default=None, help="write results here")
    return p.parse_args(argv)


def train_images(cfg: StudyConfig, params: dict[str, Any], epochs: int, n_train: int) -> int:
    bs = cfg.resolve_params(params).batch_size
    return epochs * min(bs, n_train) * max(1, n_train // bs)


def progress_curve(
    trials: list[Any], started: Any, maximize: bool, until: dt.datetime | None = None
) -> list[dict[str, float | int]]:
    """Best value so far at each completed trial that improved it, in completion order; with
    `until`, only trials completed by then (local naive time, like Optuna's)."""
    from optuna.trial import TrialState

    done = [
        t
        for t in trials
        if t.state == TrialState.COMPLETE
        and t.value is not None
        and t.datetime_complete
        and (until is None or t.datetime_complete <= until)
    ]
    done.sort(key=lambda t: t.datetime_complete)
    curve: list[dict[str, float | int]] = []
    best: float | None = None
    for t in done:
        if best is None or (t.value > best if maximize else t.value < best):
            best = float(t.value)
            at = seconds_since(started, t.datetime_complete) or 0.0
            curve.append({"t_s": at, "value": best, "trial": t.number})
    return curve


def split_at(trials: list[Any], deadline: dt.datetime) -> tuple[list[Any], list[Any]]:
    """Finished (complete or pruned) trials completed by `deadline`, and those after it."""
    from optuna.trial import TrialState

    finished = [
        t
        for t in trials
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and t.datetime_complete
    ]
    return (
        [t for t in finished if t.datetime_complete <= deadline],
        [t for t in finished if t.datetime_complete > deadline],
    )


def trial_rows(trials: list[Any], started: dt.datetime, own: dict[int, int]) -> list[dict]:
    """One row per trial: what a study's figures come from (which configurations trained how
    long, when, and to what), in launch seconds. The first lease's JSON had none, and its
    analysis had to guess."""

    def at(when: dt.datetime | None) -> float | None:
        return None if when is None else round((when - started).total_seconds(), 2)

    return [
        {
            "number": t.number,
            "state": t.state.name.lower(),
            "value": t.value if t.values is not None and len(t.values) == 1 else t.values,
            "outcome": t.user_attrs.get("outcome"),
            "epochs": own.get(t.number, 0),
            "last_step": t.last_step,
            "start_s": at(t.datetime_start),
            "end_s": at(t.datetime_complete),
            "worker": t.user_attrs.get("worker"),
            "params": dict(t.params),
            # queued by the study's enqueue_trials (its params given, not drawn)
            "enqueued": "fixed_params" in t.system_attrs,
        }
        for t in sorted(trials, key=lambda t: t.number)
    ]


def own_epochs(trials: list[Any]) -> dict[int, int]:
    """Epochs each trial trained itself (trial number -> epochs), so that no epoch counts twice.

    A retry (Optuna's retry callback, for a trial whose worker died or was interrupted) is
    created WAITING with a copy of its failed trial's attributes (`history` included, in
    versions before the copy left out the try's results), and resumes from that trial's
    checkpoint: the history it writes holds the restored epochs
    too, and the worker records the first epoch it trained as `resumed_from_epoch`
    (hpsearch.worker). So: a WAITING trial counts nothing; a retry whose history is still
    the copy of its predecessor's (it crashed, failed with an error, or ran when the launch
    stopped, without writing its own) counts nothing; any other retry counts its epochs from
    `resumed_from_epoch` on; a trial that is not a retry counts its whole history."""
    from optuna.trial import TrialState

    by_number = {t.number: t for t in trials}
    out: dict[int, int] = {}
    for t in trials:
        history = t.user_attrs.get("history") or []
        chain = t.system_attrs.get("retry_history") or []  # earlier trials of its chain
        if t.state == TrialState.WAITING:
            out[t.number] = 0
        elif not chain:
            out[t.number] = len(history)
        else:
            before = by_number.get(int(chain[-1]))
            copied = before is not None and history == (before.user_attrs.get("history") or [])
            start = int(t.user_attrs.get("resumed_from_epoch", 1))
            out[t.number] = 0 if copied else sum(1 for r in history if int(r["epoch"]) >= start)
    return out


def time_to(curve: list[dict[str, float | int]], target: float, maximize: bool) -> float | None:
    for point in curve:
        if (point["value"] >= target) if maximize else (point["value"] <= target):
            return float(point["t_s"])
    return None


def test_accuracy(
    cfg: StudyConfig, workdir: Path, best: Any, device: str
) -> tuple[float | None, str]:
    """The best trial's test accuracy and where it came from."""
    value = best.user_attrs.get("test_acc")
    if value is not None:
        return float(value), "trial attribute test_acc"
    from hpsearch.query import load_best_model
    from hpsearch.trainer import evaluate_model

    try:
        model = load_best_model(
            cfg.name, storage=str(journal_path(workdir)), workdir=workdir, device=device
        )
        acc, _ = evaluate_model(cfg, best.params, model, "test", workdir, device)
    except HpsearchError as exc:
        return None, f"not available: {exc}"
    return float(acc), "best model evaluated on test by the bench"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_output_path(args.json_path)  # before the work, not after it
        device = resolve_device(args.device)
        cfg = load_study_config(args.study, args.overrides, args.data_dir)
    except (BenchError, HpsearchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.objective.multi:
        print(f"error: --study: {cfg.name}: multi-objective studies are not supported here",
              file=sys.stderr)  # fmt: skip
        return 2
    env = environment(device, args.gpu)
    if cfg.dataset.root is not None:  # a prepared subset says how it differs (benchdata.py)
        with contextlib.suppress(OSError):
            source = Path(cfg.dataset.root) / "flowers-102" / "SOURCE.txt"
            env["dataset_source"] = source.read_text().strip()
    parent = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"study-{time.strftime('%Y%m%d-%H%M%S')}-", dir=parent))
    workdir = root / "run"
    # SIGTERM (a time limit's `timeout`) raises KeyboardInterrupt until the end, reading the
    # study and its test pass included: run_launch's own handler ends with the launch.
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    try:
        return run(args, cfg, env, device, workdir)
    except (BenchError, HpsearchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (`timeout`): the launch is already stopped
        print("interrupted: stopped (a launch running was stopped with its workers)",
              file=sys.stderr)  # fmt: skip
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def run(
    args: argparse.Namespace, cfg: StudyConfig, env: dict[str, Any], device: str, workdir: Path
) -> int:
    from hpsearch.trainer import data
    from optuna.trial import TrialState

    warm_s = 0.0 if args.cold else warm_cache(cfg, workdir)
    if not args.cold:
        print(f"data cache ready in {warm_s:.1f}s")
    cli = launch_args(
        args.study, args.overrides, data_dir=args.data_dir, workdir=workdir, device=device,
        gpu=args.gpu, workers=args.workers, trials=args.trials, timeout_s=args.timeout,
    )  # fmt: skip
    n_trials = args.trials or cfg.budget.n_trials
    print(
        f"{cfg.name}: {args.workers} workers, {args.timeout:g}s (+{args.grace:g}s grace), "
        f"up to {n_trials} trials ...",
        flush=True,
    )
    # --timeout counts from the launch command's start, --workers auto's GPU probe included
    # (search/cli.py), so the probe needs no allowance here: one would let running trials go
    # on past the study's window.
    hard_stop = args.timeout + args.grace
    with GpuWatch(device, args.gpu, args.gpu_interval) as gpu:
        # Stopped by its own time limit (`timeout` in bench/gpu/run.sh) or Ctrl-C, the bench
        # still reads and writes what the study finished (GPU time is scarce).
        launch = run_launch(
            cli, workdir / "launch.log", hard_stop, echo=args.verbose, keep_on_interrupt=True
        )
    ran, reason = launched_workers(launch)
    study = load_launched_study(cfg.name, workdir, launch)
    trials = study.get_trials(deepcopy=False)
    maximize = study.direction.name == "MAXIMIZE"
    states = {s.name.lower(): 0 for s in TrialState}
    for t in trials:
        states[t.state.name.lower()] += 1
    # A re-queued retry copies its failed trial's attributes: count the FAIL ones only.
    interrupted = sum(
        1
        for t in trials
        if t.state == TrialState.FAIL and t.user_attrs.get("outcome") == "interrupted"
    )
    src = data.get_source(cfg, "train")
    n_train = len(src) if src is not None else 0
    epochs = images = 0
    numbered = {t.number: t for t in trials}
    for number, e in own_epochs(trials).items():
        epochs += e
        images += train_images(cfg, numbered[number].params, e, n_train)
    # The budget: trials completed by the time-out count; the grace period's are extra.
    deadline = launch.started + dt.timedelta(seconds=args.timeout)
    in_budget, in_grace = split_at(trials, deadline)
    finished = in_budget + in_grace
    curve = progress_curve(trials, launch.started, maximize, until=deadline)
    curve_all = progress_curve(trials, launch.started, maximize)
    best = best_trial([t for t in in_budget if t.state == TrialState.COMPLETE], maximize)
    best_all = best_trial([t for t in finished if t.state == TrialState.COMPLETE], maximize)
    best_drawn = best_trial(
        [t for t in in_budget
         if t.state == TrialState.COMPLETE and "fixed_params" not in t.system_attrs],
        maximize,
    )  # fmt: skip
    test_acc, test_from = (None, "no completed trial")
    if best is not None and launch.interrupted:  # before the time limit's SIGKILL
        test_from = "not evaluated: the bench was interrupted"
    elif best is not None:
        test_from = "not evaluated: the bench was stopped before its test pass"
    result: dict[str, Any] = {
        "workers": ran,
        "auto_reason": reason or None,
        "launch_returncode": launch.returncode,
        "bench_stops": launch.stops,
        "wall_s": launch.wall_s,
        "states": states,  # all trials, the grace period's included
        "finished": len(in_budget),  # complete or pruned by the time-out
        "finished_in_grace": len(in_grace),
        "budget_states": {  # by the time-out: what the budget's figures count
            "complete": sum(1 for t in in_budget if t.state == TrialState.COMPLETE),
            "pruned": sum(1 for t in in_budget if t.state == TrialState.PRUNED),
        },
        "grace_states": {
            "complete": sum(1 for t in in_grace if t.state == TrialState.COMPLETE),
            "pruned": sum(1 for t in in_grace if t.state == TrialState.PRUNED),
        },
        "finished_with_grace": states["complete"] + states["pruned"],
        "interrupted": interrupted,
        "epochs": epochs,
        "train_images": images,
        "images_per_second_e2e": images / launch.wall_s,
        "metric": cfg.objective.metrics[0],
        "direction": "maximize" if maximize else "minimize",
        "best_value": best.value if best is not None else None,
        "best_trial": best.number if best is not None else None,
        "best_params": dict(best.params) if best is not None else None,
        "best_enqueued": best is not None and "fixed_params" in best.system_attrs,
        # the search's own: the best of the trials it drew (enqueue_trials' left out)
        "best_drawn_value": best_drawn.value if best_drawn is not None else None,
        "best_drawn_trial": best_drawn.number if best_drawn is not None else None,
        "best_epochs": len(best.user_attrs.get("history", [])) if best is not None else None,
        "test_acc": test_acc,
        "test_acc_from": test_from,
        "time_to_best_s": curve[-1]["t_s"] if curve else None,
        "time_to_target_s": {str(x): time_to(curve, x, maximize) for x in args.target},
        "curve": curve,
        # the same with the trials completed in the grace period (the figures before budget
        # and grace were told apart)
        "best_value_with_grace": best_all.value if best_all is not None else None,
        "best_trial_with_grace": best_all.number if best_all is not None else None,
        "time_to_best_with_grace_s": curve_all[-1]["t_s"] if curve_all else None,
        "time_to_target_with_grace_s": {
            str(x): time_to(curve_all, x, maximize) for x in args.target
        },
        "curve_with_grace": curve_all,
        "gpu_utilization_mean": gpu.utilization,
        # from the first trial's start to the time-out: without start-up and the stop
        "gpu_utilization_working": gpu.mean_between(
            min((t.datetime_start for t in trials if t.datetime_start), default=None),
            launch.started + dt.timedelta(seconds=args.timeout),
        ),
        "gpu": gpu.summary,
        "timings": trial_timings(workdir),
        "trials": trial_rows(trials, launch.started, own_epochs(trials)),
    }
    if launch.interrupted:
        result["error"] = "interrupted (Ctrl-C or the bench's time limit): the launch was stopped"
    elif launch.returncode not in (0, 130, 143, 129):  # a stop by Ctrl-C, SIGTERM or SIGHUP
        result["error"] = f"launch exit code {launch.returncode}; last lines:\n{launch.tail()}"

    def write() -> None:
        if args.json_path:
            out = {
                "bench": "study",
                "environment": env,
                "args": vars(args),
                "study": cfg.name,
                "cache_warm_s": warm_s,
                "workdir": str(workdir) if args.keep else None,
                "result": result,
            }
            Path(args.json_path).write_text(json.dumps(out, indent=2, default=str))

    write()  # the study's figures, before the test pass (minutes on a CPU): a stop keeps them
    if best is not None and not launch.interrupted:
        try:
            result["test_acc"], result["test_acc_from"] = test_accuracy(cfg, workdir, best, device)
        except Exception as exc:  # the study's figures stand without it
            result["test_acc_from"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        write()
    print_table(cfg, args, env, result)
    if args.json_path:
        print(f"JSON: {args.json_path}")
    if "error" in result:
        print(result["error"], file=sys.stderr)
        return 130 if launch.interrupted else 1
    return 0


def best_trial(done: list[Any], maximize: bool) -> Any:
    """The completed trial with the best value; None when there is none."""
    done = [t for t in done if t.value is not None]
    return (max if maximize else min)(done, key=lambda t: t.value) if done else None


def print_table(
    cfg: StudyConfig, args: argparse.Namespace, env: dict[str, Any], r: dict[str, Any]
) -> None:
    where = env.get("gpu") or f"cpu ({env['cpu_count']} cores)"
    s, b, g = r["states"], r["budget_states"], r["grace_states"]
    best = (
        f"{r['best_value']:.4f} (trial {r['best_trial']}, {r['best_epochs']} epochs"
        + (", enqueued)" if r.get("best_enqueued") else ")")
        if r["best_value"] is not None
        else "-"
    )
    stopped = f" (bench sent {' then '.join(r['bench_stops'])})" if r["bench_stops"] else ""
    rows = [
        ("wall s", f"{r['wall_s']:.1f}{stopped}"),
        ("complete / pruned by time-out", f"{b['complete']} / {b['pruned']}"),
        ("complete / pruned in grace", f"{g['complete']} / {g['pruned']}"),
        ("failed / interrupted / waiting", f"{s['fail']} / {r['interrupted']} / {s['waiting']}"),
        ("epochs / train images", f"{r['epochs']} / {r['train_images']}"),
        ("train img/s (e2e)", f"{r['images_per_second_e2e']:.1f}"),
        (f"best {r['metric']} by time-out", best),
        *(
            [(f"best {r['metric']} with grace", f"{r['best_value_with_grace']:.4f} (trial "
              f"{r['best_trial_with_grace']})")]
            if r["best_trial_with_grace"] != r["best_trial"]
            else []
        ),
        *(
            [(f"best drawn {r['metric']} by time-out",
              fmt(r["best_drawn_value"], ".4f")
              + (f" (trial {r['best_drawn_trial']})" if r["best_drawn_value"] is not None else ""))]
            if r.get("best_enqueued")
            else []
        ),
        ("test acc of best", f"{fmt(r['test_acc'], '.4f')} ({r['test_acc_from']})"),
        ("time to best s", fmt(r["time_to_best_s"])),
        *((f"time to {k} s", fmt(v)) for k, v in r["time_to_target_s"].items()),
        ("GPU util mean %", fmt(r["gpu_utilization_mean"])),
        ("GPU util %, 1st trial to time-out", fmt(r["gpu_utilization_working"])),
    ]  # fmt: skip
    workers = f"auto ({r['workers']})" if args.workers == "auto" else args.workers
    print(
        f"\n{cfg.name}: {workers} workers, {args.timeout:g} s budget (+{args.grace:g} s "
        f"grace) on {where}"
    )
    if r["auto_reason"]:
        print(f"  --workers auto: {r['auto_reason']}")
    if env.get("dataset_source"):  # e.g. test JPEGs re-encoded: test acc reads lower
        print(f"  data: {env['dataset_source']}")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    sys.exit(main())
