"""The figures the benchmarks compute from what they measured (percentiles, rates, epochs,
the time budget) and the checks that make a bad run an error rather than a result: a figure
in docs/performance.md is only as right as these."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import math
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from bench_helpers import ready_child
from optuna.trial import TrialState

BENCH = Path(__file__).resolve().parents[2] / "bench"
PG = "postgresql://postgres@127.0.0.1:5432"


def _bench_module(name: str) -> ModuleType:
    """`bench/NAME.py` as its script sees it: `bench/` on sys.path, `common` importable."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def common() -> ModuleType:
    return _bench_module("common")


@pytest.fixture(scope="module")
def storage() -> ModuleType:
    return _bench_module("storage")


@pytest.fixture(scope="module")
def study() -> ModuleType:
    return _bench_module("study")


@pytest.fixture(scope="module")
def overhead() -> ModuleType:
    return _bench_module("overhead")


@pytest.fixture(scope="module")
def packing() -> ModuleType:
    return _bench_module("packing")


# --- percentiles --------------------------------------------------------------------------


def test_percentile_p50_is_the_median_for_an_even_count(common: ModuleType) -> None:
    # A rounded rank (round(0.5 * 3) == 2, round(0.5 * 1) == 0: banker's rounding) picked
    # one middle value or the other; the median is their mean.
    assert common.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert common.percentile([4.0, 1.0], 50) == 2.5
    assert common.percentile([3.0, 1.0, 2.0], 50) == 2.0
    values = [float(x) for x in range(10)]
    assert common.percentile(values, 50) == statistics.median(values)


def test_percentile_p99_is_linear_between_ranks(common: ModuleType) -> None:
    values = [float(x) for x in range(1, 101)]  # 1..100: p99 at rank 98.01
    assert common.percentile(values, 99) == pytest.approx(99.01)
    assert common.percentile([1.0, 2.0], 99) == pytest.approx(1.99)  # n < 100: near the max
    assert common.percentile([5.0], 99) == 5.0
    assert common.percentile([1.0, 9.0], 0) == 1.0 and common.percentile([1.0, 9.0], 100) == 9.0
    assert math.isnan(common.percentile([], 50))
    with pytest.raises(ValueError):
        common.percentile([1.0], 101)


def test_the_benches_use_it(overhead: ModuleType) -> None:
    tracking = _bench_module("tracking")
    assert overhead.pct([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert tracking.pct([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    s = overhead.summary([1.0, 2.0, 3.0, 4.0])
    assert s["n"] == 4 and s["p50"] == 2.5  # the keys docs and JSON readers use, kept
    assert tracking.summary_ms([0.001, 0.002])["p50"] == pytest.approx(1.5)


def test_overhead_ratio_is_the_median_of_the_pairs(overhead: ModuleType) -> None:
    # Machine Q's three pairs (plain, hpsearch wall s): the sides' medians (109.3, 118.1 s)
    # came from different pairs and gave 1.080, below every pair but the first.
    pairs = [(119.4, 114.4), (109.3, 122.2), (103.4, 118.1)]
    ratios = [h / p for p, h in pairs]
    assert overhead.headline_ratio(ratios) == pytest.approx(122.2 / 109.3)
    assert overhead.headline_ratio([1.2]) == 1.2
    assert overhead.headline_ratio([]) is None


def test_overhead_resolves_a_relative_data_dir(
    overhead: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sides run with their scratch folder as cwd, where "data" is another folder.
    monkeypatch.chdir(tmp_path)
    args = overhead.parse_args(["--data-dir", "data"])
    assert args.data_dir == str(tmp_path / "data")


# --- bench/packing.py ---------------------------------------------------------------------


def _row(number: int, start_s: float, duration_s: float, state: str = "COMPLETE") -> dict:
    return {"number": number, "state": state, "start_s": start_s, "duration_s": duration_s}


def test_packing_rate_over_the_trial_window_leaves_start_up_out(packing: ModuleType) -> None:
    # W=1: two 10 s trials after 12 s of start-up; W=4: eight 20 s trials, four at a time,
    # after the same 12 s. Over the launch (32 s, 52 s) the 4 workers look 2.46x as fast;
    # over the window from the first start to the last end (20 s, 40 s) they are 2.0x.
    one = [_row(0, 12.0, 10.0), _row(1, 22.0, 10.0)]
    four = [_row(i, 12.0 + 20.0 * (i // 4), 20.0) for i in range(8)]
    assert packing.window_trials_per_hour(one) == pytest.approx(2 / 20 * 3600)
    assert packing.window_trials_per_hour(four) == pytest.approx(8 / 40 * 3600)
    results = [
        {"workers_arg": "1", "complete": 2, "trials_per_hour": 2 / 32 * 3600,
         "trials_per_hour_window": packing.window_trials_per_hour(one)},
        {"workers_arg": "4", "complete": 8, "trials_per_hour": 8 / 52 * 3600,
         "trials_per_hour_window": packing.window_trials_per_hour(four)},
    ]  # fmt: skip
    packing.speedups(results, "trials_per_hour")
    packing.speedups(results, "trials_per_hour_window")
    assert results[1]["speedup"] == pytest.approx(2.46, abs=0.01)
    assert results[1]["speedup_window"] == pytest.approx(2.0)
    # a pruned trial counts in the window's start, not among the completed
    pruned = [_row(0, 5.0, 1.0, "PRUNED"), *one]
    assert packing.window_trials_per_hour(pruned) == pytest.approx(2 / 27 * 3600)
    assert packing.window_trials_per_hour(one[:1]) is None  # one trial: no window


def test_packing_speedups_are_against_w1_only(packing: ModuleType) -> None:
    """With one trial per worker W=1 has no window: the W=2 row showed `speedup win 1.00`
    against itself, the first row that had one."""
    results = [
        {"workers_arg": "1", "complete": 1, "trials_per_hour": 100.0,
         "trials_per_hour_window": None},
        {"workers_arg": "2", "complete": 2, "trials_per_hour": 180.0,
         "trials_per_hour_window": 200.0},
        {"workers_arg": "4", "complete": 4, "trials_per_hour": 300.0,
         "trials_per_hour_window": 320.0},
    ]  # fmt: skip
    packing.speedups(results, "trials_per_hour")
    packing.speedups(results, "trials_per_hour_window")
    assert [r["speedup"] for r in results] == [1.0, 1.8, 3.0]
    assert [r["speedup_window"] for r in results] == [None, None, None]
    no_one = results[1:]  # --workers 2 4: no baseline
    packing.speedups(no_one, "trials_per_hour")
    assert [r["speedup"] for r in no_one] == [None, None]


# --- bench/storage.py ---------------------------------------------------------------------


def _result(trials: int, ok: int, reports: int, errors: int = 0, elapsed: float = 2.0) -> dict:
    return {"trials": trials, "ok": ok, "reports": reports, "errors": errors,
            "elapsed": elapsed, "lat": None, "crash": None}  # fmt: skip


def test_storage_row_rates_errors_and_work_per_trial(storage: ModuleType) -> None:
    results = [_result(10, 8, 20, errors=2), _result(6, 6, 12)]
    lat = {"ask": [1.0, 2.0, 3.0, 4.0], "report": [], "tell": [5.0]}
    row = storage.make_row("hpsearch", 2, results, lat, {"COMPLETE": 4, "PRUNED": 10, "FAIL": 2})
    assert row["trials"] == 14 and row["trials_all"] == 16 and row["errors"] == 2
    assert row["trials_per_s"] == pytest.approx(8 / 2 + 6 / 2)  # failed trials not counted
    assert row["trials_per_s_all"] == pytest.approx(10 / 2 + 6 / 2)
    assert row["reports"] == 32 and row["reports_per_s"] == pytest.approx(16.0)
    assert row["reports_per_trial"] == pytest.approx(32 / 14)
    assert row["pruned_share"] == pytest.approx(10 / 14)
    assert row["ask_n"] == 4 and row["ask_p50_ms"] == 2.5 and row["report_p50_ms"] is None
    assert row["tell_n"] == 1 and row["tell_p99_ms"] == 5.0


def _exit_at_once(code: int) -> None:
    os._exit(code)


def _put_crash(out: Any) -> None:
    out.put({"crash": "OperationalError: the database is gone"})


def test_storage_a_dead_worker_ends_the_run_at_once(storage: ModuleType) -> None:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    for target, args, match in [
        (_exit_at_once, (3,), "exited with code 3"),
        (_put_crash, (out,), "database is gone"),
    ]:
        proc = ctx.Process(target=target, args=args)
        proc.start()
        t0 = time.monotonic()
        with pytest.raises(storage.WorkerCrash, match=match):
            storage.collect([proc], out, limit_s=300)
        assert time.monotonic() - t0 < 10  # not the queue's 300 s
        proc.join(timeout=10)


def _pg_up() -> bool:
    try:
        import psycopg2

        psycopg2.connect(f"{PG}/postgres", connect_timeout=3).close()
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _pg_up(), reason="needs PostgreSQL on 127.0.0.1:5432")
def test_storage_plain_workers_draw_from_their_own_streams(
    storage: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two plain workers on one seed proposed the same parameters (the first trial of each
    alike); each its own stream, as hpsearch's workers draw, they do not."""
    import psycopg2

    kept: list[str] = []
    monkeypatch.setattr(storage, "drop_database", lambda base, name: kept.append(name))
    args = argparse.Namespace(study="tiny", epochs=3, seconds=1.0, pg=PG, epoch_s=0.0)
    try:
        row = storage.run_one(args, "plain", 2)
        assert row["errors"] == 0 and row["trials"] >= 2 and row["reports"] >= row["trials"]
        conn = psycopg2.connect(f"{PG}/{kept[0]}")
        with conn, conn.cursor() as cur:
            cur.execute("SELECT param_value FROM trial_params WHERE param_name = 'lr'")
            lrs = [r[0] for r in cur.fetchall()]
        conn.close()
        assert len(lrs) >= 2 and len(set(lrs)) == len(lrs)
    finally:
        for name in kept:
            _bench_module("common").drop_database(PG, name)


# --- bench/study.py -----------------------------------------------------------------------

T0 = dt.datetime(2026, 1, 1, 12, 0, 0)


def _trial(number: int, state: TrialState, epochs: list[int] | None = None, *,
           value: float | None = None, done_s: float | None = None,
           chain: list[int] | None = None, resumed: int | None = None) -> Any:  # fmt: skip
    user: dict[str, Any] = {}
    if epochs is not None:
        user["history"] = [{"epoch": e, "val_acc": 0.1 * e} for e in epochs]
    if resumed is not None:
        user["resumed_from_epoch"] = resumed
    system = {"failed_trial": chain[0], "retry_history": chain} if chain else {}
    return SimpleNamespace(
        number=number, state=state, value=value, user_attrs=user, system_attrs=system,
        datetime_complete=None if done_s is None else T0 + dt.timedelta(seconds=done_s),
    )  # fmt: skip


def test_study_counts_each_trained_epoch_once(study: ModuleType) -> None:
    C, F, W, R = TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING, TrialState.RUNNING
    trials = [
        _trial(0, F, [1, 2, 3]),  # interrupted after 3 epochs
        _trial(1, F, [1, 2, 3, 4, 5], chain=[0], resumed=4),  # its retry: 4, 5; interrupted
        _trial(2, W, [1, 2, 3, 4, 5], chain=[0, 1], resumed=4),  # queued: a copy of 1's
        _trial(3, C, [1, 2]),
        _trial(4, F, [1, 2]),  # interrupted
        _trial(5, F, [1, 2], chain=[4]),  # its retry: died before writing anything
        _trial(6, C, [1, 2, 3, 4], chain=[4, 5], resumed=3),  # the next one trained 3, 4
        _trial(7, F, [1]),  # interrupted at the stop ...
        _trial(8, R, [1], chain=[7]),  # ... its retry still running when the launch ended
    ]
    got = study.own_epochs(trials)
    assert got == {0: 3, 1: 2, 2: 0, 3: 2, 4: 2, 5: 0, 6: 2, 7: 1, 8: 0}
    assert sum(got.values()) == 12  # the trials' own histories hold 3 + 2 + 2 + 2 + 2 + 1


def test_study_budget_is_the_time_out_not_the_grace(study: ModuleType) -> None:
    C, P = TrialState.COMPLETE, TrialState.PRUNED
    trials = [
        _trial(0, C, value=0.3, done_s=50),
        _trial(1, P, value=0.1, done_s=80),
        _trial(2, C, value=0.5, done_s=100),  # at the time-out: counts
        _trial(3, C, value=0.9, done_s=130),  # in the grace period
        _trial(4, P, value=0.2, done_s=140),
        _trial(5, TrialState.RUNNING),
    ]
    deadline = T0 + dt.timedelta(seconds=100)
    in_budget, in_grace = study.split_at(trials, deadline)
    assert [t.number for t in in_budget] == [0, 1, 2]
    assert [t.number for t in in_grace] == [3, 4]
    curve = study.progress_curve(trials, T0, maximize=True, until=deadline)
    assert [(p["trial"], p["t_s"]) for p in curve] == [(0, 50.0), (2, 100.0)]
    assert study.time_to(curve, 0.8, True) is None
    assert study.progress_curve(trials, T0, maximize=True)[-1]["trial"] == 3
    done = [t for t in in_budget if t.state == C]
    assert study.best_trial(done, maximize=True).number == 2
    assert study.best_trial([], maximize=True) is None


# --- bench/packing.py: every trial once, or an error ---------------------------------------


def test_packing_asks_for_no_retries(common: ModuleType) -> None:
    args = common.launch_args("tiny", [], data_dir="/d", workdir=Path("/w"), device="cpu",
                              gpu=None, workers=2, trials=4, max_restarts=0, max_retries=0)  # fmt: skip
    assert args[args.index("--max-restarts") + 1] == "0"
    assert args[args.index("--max-retries") + 1] == "0"
    assert "--max-retries" not in common.launch_args(
        "tiny", [], data_dir="/d", workdir=Path("/w"), device="cpu", gpu=None, workers=1
    )
    text = (BENCH / "packing.py").read_text()
    assert "max_restarts=0, max_retries=0" in text


def test_the_workers_a_launch_ran_are_read_from_its_log(common: ModuleType, tmp_path: Path) -> None:
    log = tmp_path / "launch.log"
    run = common.LaunchRun(returncode=0, wall_s=1.0, started=T0, log=log)
    for line, n in (("study tiny: 4 trials, 2 workers,", 2), ("study t: 1 trial, 1 worker,", 1)):
        log.write_text(f"{line} storage journal:/x\n--workers auto: fits 2\n")
        assert common.launched_workers(run) == (n, "fits 2")


def test_worker_deaths_are_read_from_the_launch_log(common: ModuleType, tmp_path: Path) -> None:
    log = tmp_path / "launch.log"
    log.write_text(
        "study tiny: 4 trials, 2 workers\n"
        "worker 1 died (signal 9); trial 3 re-queued to resume; not restarted (no restarts "
        "left). Last log line: -\n"
        "[  12s] 2/4 done, running 1\n"
    )
    run = common.LaunchRun(returncode=0, wall_s=1.0, started=T0, log=log)
    assert common.worker_deaths(run) == [
        "worker 1 died (signal 9); trial 3 re-queued to resume; not restarted (no restarts "
        "left). Last log line: -"
    ]
    # A launch's start fails the trials of a previous launch's dead workers (the launcher's
    # own words for it, as search/launcher.py says them).
    log.write_text("its worker was gone: trial 2 re-queued to resume\n4/4 done\n")
    assert common.worker_deaths(run) == ["its worker was gone: trial 2 re-queued to resume"]
    log.write_text("study tiny: 4 trials, 2 workers\n4/4 done\n")
    assert common.worker_deaths(run) == []


# --- bench/overhead.py: SIGTERM stops what it started -----------------------------------


def test_overhead_sigterm_becomes_one_keyboard_interrupt(
    common: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """overhead.py (and storage, trainer, tracking, threads) run through common.run_main."""
    monkeypatch.setattr(common, "_sigterm_seen", False)
    with pytest.raises(KeyboardInterrupt):
        common._sigterm_once(signal.SIGTERM, None)
    common._sigterm_once(signal.SIGTERM, None)  # a second one lets the clean-up finish


def test_overhead_stop_now_escalates(overhead: ModuleType, tmp_path: Path) -> None:
    """A child that survives the first SIGTERM (a launcher stopping gracefully) is gone
    after the second, well before a minute."""
    child = (
        "import signal, time\n"
        "n = []\n"
        "def on_term(*a):\n"
        "    n.append(1)\n"
        "    if len(n) > 1: raise SystemExit(7)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    proc = ready_child(overhead, child, tmp_path)
    t0 = time.monotonic()
    proc.stop_now()
    # the second SIGTERM comes STOP_GRACE_S after the first (the launch's graceful stop)
    assert proc.popen.returncode == 7 and time.monotonic() - t0 < overhead.STOP_GRACE_S + 5
