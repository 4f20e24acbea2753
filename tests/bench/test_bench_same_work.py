"""Both sides of a comparison do the same work: the plain baselines prune as hpsearch's
worker does (never at the last epoch), and overhead.py gives no verdict when they did not."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from bench_helpers import bench_module, ready_child


class FakeTrial:
    def __init__(self) -> None:
        self.reported: list[int] = []
        self.asked: list[int] = []

    def report(self, value: float, step: int) -> None:
        self.reported.append(step)

    def should_prune(self) -> bool:
        self.asked.append(self.reported[-1])
        return True  # a pruner that would stop every trial


def test_overhead_plain_report_never_prunes_at_the_last_epoch() -> None:
    overhead = bench_module("overhead")
    trial, sink = FakeTrial(), []
    report = overhead.timed_report(trial, sink, last_step=3)
    assert [report(e, 0.5) for e in (1, 2, 3)] == [True, True, False]
    assert trial.reported == [1, 2, 3] and trial.asked == [1, 2]  # epoch 3: recorded only
    assert len(sink) == 3


def test_storage_plain_loop_never_prunes_at_the_last_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one epoch a trial's only report is its last: however eager the pruner, every
    trial completes, as on the hpsearch side (before, all were pruned)."""
    import optuna
    from hpsearch.config import load_config
    from hpsearch.study import create_or_load

    storage_bench = bench_module("storage")
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    cfg = load_config("tiny", overrides=["budget.max_epochs=2", "budget.n_trials=1000"])
    url = f"sqlite:///{tmp_path / 'o.db'}"
    create_or_load(cfg, optuna.storages.RDBStorage(url))
    lat: dict[str, list[float]] = {"ask": [], "report": [], "tell": []}
    n = storage_bench._plain_loop(url, cfg, 0, time.time(), 0.3, lat, [0.0])
    study = optuna.load_study(study_name=cfg.name, storage=url)
    states = [t.state.name for t in study.get_trials()]
    assert n >= 1 and states == ["PRUNED"] * n  # pruned at epoch 1 of 2
    cfg1 = load_config("tiny", overrides=["budget.max_epochs=1", "budget.n_trials=1000"])
    cfg1 = cfg1.model_copy(update={"name": "tiny-one-epoch"})
    create_or_load(cfg1, optuna.storages.RDBStorage(url))
    n = storage_bench._plain_loop(url, cfg1, 0, time.time(), 0.3, lat, [0.0])
    study = optuna.load_study(study_name=cfg1.name, storage=url)
    assert n >= 1 and [t.state.name for t in study.get_trials()] == ["COMPLETE"] * n


def _run(states_plain: list[str], states_hps: list[str]) -> dict[str, Any]:
    overhead = bench_module("overhead")

    def side(name: str, states: list[str]) -> Any:
        trials = [{"number": i, "state": s, "params": {"lr": 0.1}, "value": 0.5,
                   "epochs_reported": 2} for i, s in enumerate(states)]  # fmt: skip
        return overhead.Side(name, 0, 1.0, 0, trials, None, "")

    plain, hps = side("plain", states_plain), side("hpsearch", states_hps)
    return {
        "repeat": 0,
        "same_work": overhead.compare_work(plain, hps),
        "plain": {"trials": plain.trials},
        "hpsearch": {"trials": hps.trials},
    }


def test_overhead_gives_no_verdict_when_the_sides_did_different_work(
    capsys: pytest.CaptureFixture[str],
) -> None:
    overhead = bench_module("overhead")
    alike = _run(["complete", "pruned"], ["complete", "pruned"])
    unlike = _run(["complete", "pruned"], ["complete", "complete"])
    assert overhead.like_for_like([alike]) is None
    why = overhead.like_for_like([alike, {**unlike, "repeat": 1}])
    assert why is not None and "repeat 2" in why and "1/2 alike" in why
    # several workers: the order differs, the counts of each state must agree
    assert overhead.like_for_like([_run(["pruned", "complete"], ["complete", "pruned"])], 2) is None
    assert overhead.like_for_like([unlike], 2) is not None
    assert overhead.verdict(2.0, None) == "MISSED"
    assert overhead.verdict(2.0, why).startswith("none: not like for like")


def test_a_stopped_launch_gets_its_grace_before_the_second_sigterm(tmp_path: Path) -> None:
    """The bench sent its second SIGTERM 1 s after the first, cutting the launch's graceful
    stop short (its worker's $TMPDIR/hpsearch-artifacts-* folder was left behind). A child
    that takes 2 s to stop cleanly now gets one SIGTERM only."""

    overhead = bench_module("overhead")
    assert overhead.STOP_GRACE_S >= 5.0
    seen = tmp_path / "seen"
    child = (
        "import signal, sys, time\n"
        "n = 0\n"
        "def on_term(signum, frame):\n"
        "    global n\n"
        "    n += 1\n"
        f"    open({str(seen)!r}, 'a').write('T')\n"
        "    if n > 1: sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "print('ready', flush=True)\n"
        "while n == 0: time.sleep(0.05)\n"
        "time.sleep(2.0)  # the graceful stop: a checkpoint, the workers' exit, clean-up\n"
    )
    proc = ready_child(overhead, child, tmp_path)
    proc.stop_now()
    assert proc.popen.returncode == 0
    assert seen.read_text() == "T"
