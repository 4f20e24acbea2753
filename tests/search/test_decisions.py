"""Pure decision functions: budget, GPU placement, restarts, storage URLs, sampling."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import optuna
import pytest
from hpsearch.config import load_config
from hpsearch.errors import ConfigError, DeviceError, StorageError
from hpsearch.launcher import (
    assign_gpus,
    check_gpus,
    eta_seconds,
    parse_gpus,
    running_epochs,
    should_restart,
)
from hpsearch.storage import normalize_url, redact, resolve_storage
from hpsearch.study import (
    budget_done,
    counts_once_requeued,
    dominates,
    grid_space,
    make_pruner,
    make_sampler,
    may_start_trial,
    sampler_seed,
    suggest,
)
from hpsearch.trainer import EpochRecord
from hpsearch.worker import resumed_from_epoch, unreported_epochs


def test_may_start_trial_counts_finished_and_running_but_not_failed() -> None:
    assert may_start_trial({"complete": 2, "pruned": 1, "running": 1}, 5)
    assert not may_start_trial({"complete": 2, "pruned": 1, "running": 2}, 5)
    assert may_start_trial({"complete": 4, "fail": 3}, 5)
    assert may_start_trial({"complete": 5, "waiting": 1}, 5)  # a queued retry is always run


def test_held_trials_count_as_queued_again_for_a_restart() -> None:
    # One worker, one trial: it died while the MLflow server started (held, still RUNNING).
    # Counted as running, the budget looks spent and the worker would not be restarted.
    counts = {"complete": 0, "running": 1}
    assert not may_start_trial(counts, 1)
    once = counts_once_requeued(counts, 1)
    assert once == {"complete": 0, "running": 0, "waiting": 1} and may_start_trial(once, 1)
    assert counts == {"complete": 0, "running": 1}  # not changed in place
    assert counts_once_requeued({"running": 1}, 3) == {"running": 0, "waiting": 1}  # bounded
    assert counts_once_requeued({"complete": 2}, 0) == {"complete": 2, "running": 0, "waiting": 0}


def test_budget_done_only_when_results_are_final() -> None:
    assert budget_done({"complete": 3, "pruned": 2, "fail": 1}, 5)
    assert not budget_done({"complete": 3, "pruned": 1}, 5)
    assert not budget_done({"complete": 5, "running": 1}, 5)  # it may fail and be retried
    assert not budget_done({"complete": 5, "waiting": 1}, 5)  # a queued retry still runs
    assert budget_done({"complete": 6}, 5)  # a relaunch with a lower --trials


def test_assign_gpus_round_robin() -> None:
    assert assign_gpus(4, ["0", "1"]) == ["0", "1", "0", "1"]
    assert assign_gpus(3, ["1"]) == ["1", "1", "1"]
    assert assign_gpus(2, None) == [None, None]


def test_gpu_and_device_checks() -> None:
    assert parse_gpus("0, 1") == ["0", "1"]
    assert parse_gpus(None) is None
    for bad in ("0,,1", "", " ", ","):  # an empty one was taken for no --gpus at all
        with pytest.raises(ConfigError, match="comma-separated"):
            parse_gpus(bad)
    with pytest.raises(DeviceError, match=r"--gpus: '7': no such GPU; this machine has 1"):
        check_gpus(["7"], 1, "auto")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        check_gpus(None, 0, "cuda")
    check_gpus(["0", "GPU-abc"], 1, "auto")
    assert parse_gpus("GPU-8f2c,MIG-1a2b,3") == ["GPU-8f2c", "MIG-1a2b", "3"]
    for bad in ("-1", "abc", "0,x"):
        with pytest.raises(ConfigError, match=r"--gpus: '(-1|abc|x)': not a GPU index"):
            parse_gpus(bad)
    with pytest.raises(DeviceError, match=r"--gpus: '0': no such GPU; this machine has 0"):
        check_gpus(["0"], 0, "auto")  # no GPU: not quietly the CPU
    with pytest.raises(DeviceError, match=r"--gpus: 'GPU-abc': CUDA is not available"):
        check_gpus(["GPU-abc"], 0, "auto")


def test_should_restart_is_bounded() -> None:
    assert should_restart(-9, 0, 3, True)
    assert not should_restart(-9, 3, 3, True)
    assert not should_restart(0, 0, 3, True)
    assert not should_restart(1, 0, 3, False)
    assert not should_restart(65, 0, 3, True)  # its data: every restart fails the same
    assert not should_restart(78, 0, 3, True)  # its --train-fn: the same


def test_eta() -> None:
    assert eta_seconds(2, 10, 20.0) == pytest.approx(80.0)
    assert eta_seconds(0, 10, 5.0) is None
    # A resumed study: 4 finished before this launch, 1 in its 60 s; 2 left (QA: "eta 1s"
    # with three 2-minute trials left, the earlier trials counted at this launch's rate).
    assert eta_seconds(5, 7, 60.0, finished_here=1) == pytest.approx(120.0)
    assert eta_seconds(4, 7, 60.0, finished_here=0) is None
    assert eta_seconds(7, 7, 60.0, finished_here=3) is None
    # Running trials count by the share of max_epochs they trained here (QA: "eta -" until
    # a trial ended): 2 of 10 epochs of one trial in 30 s, 4 trials: 4 - 0.2 left at that.
    assert eta_seconds(0, 4, 30.0, 0, [(2, 0)], 10) == pytest.approx(30.0 / 0.2 * 3.8)
    # Two running, one a retry that came with 5 epochs of its chain's: 1 + 1 of 10 here.
    assert eta_seconds(1, 4, 60.0, 1, [(1, 0), (6, 5)], 10) == pytest.approx(60.0 / 1.2 * 2.3)
    assert eta_seconds(0, 4, 30.0, 0, [(0, 0)], 10) is None  # no epoch yet: no rate
    # The last trial past its last epoch: its end (test evaluation, uploads) is left, not 0 s.
    assert eta_seconds(3, 4, 90.0, 3, [(2, 0)], 2) == pytest.approx(90.0 / 4 * 0.25)


def test_running_epochs_count_a_retrys_inherited_reports_as_done_before() -> None:
    from optuna.trial import FrozenTrial, TrialState, create_trial

    def running(number: int, reports: dict[int, float], retry: bool = False) -> FrozenTrial:
        t = create_trial(
            state=TrialState.RUNNING,
            intermediate_values=reports,
            system_attrs={"retry_history": [0]} if retry else {},
        )
        t.number = number
        return t

    seen: dict[int, int] = {}
    fresh, retry = running(1, {1: 0.2, 2: 0.3}), running(2, {1: 0.1, 2: 0.2, 3: 0.3}, True)
    done = create_trial(value=0.5, intermediate_values={1: 0.5})
    assert running_epochs([fresh, retry, done], seen) == [(2, 0), (3, 3)]
    # Later: the retry trained two epochs here; its base stays what it came with.
    later = running(2, {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4, 5: 0.5}, True)
    assert running_epochs([later, running(3, {})], seen) == [(5, 3), (0, 0)]


def test_storage_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPSEARCH_STORAGE", raising=False)
    # psycopg2 is what we install; a plain postgresql:// URL must map to it.
    assert normalize_url("postgresql://u:p@h/db") == "postgresql+psycopg2://u:p@h/db"
    assert normalize_url("postgres://h/db") == "postgresql+psycopg2://h/db"
    assert normalize_url("postgresql+psycopg2://h/db") == "postgresql+psycopg2://h/db"
    assert redact("postgresql://u:s3cret@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert "s3cret" not in resolve_storage("postgresql://u:s3cret@h/db", tmp_path).display
    # libpq's password parameter, and a raw "@" in the password (the host's is the last)
    for url in (
        "postgresql://u@h/db?sslmode=require&password=s3cret",
        "postgresql://u:s3@cret@h/db",
        "postgresql://u:s3/cret@h/db",
        "postgresql://u:s3?cret@h/db",
        "postgresql://u:s3#cret@h/db",
        "postgresql://u:s3cret@h:notaport/db",
        "postgresql://u:s3/cret@h:notaport/db",
    ):
        assert "cret" not in redact(url), url
        if "s3@" in url:  # SQLAlchemy's host would be "cret@h": refused, not shown
            with pytest.raises(StorageError, match="raw '@'") as err:
                resolve_storage(url, tmp_path)
            assert "cret" not in str(err.value)
        elif "notaport" not in url:
            assert "cret" not in resolve_storage(url, tmp_path).display, url
    assert redact("postgresql://u@h/db?password=s3cret") == "postgresql://u@h/db?password=***"
    spec = resolve_storage(None, tmp_path)
    assert spec.kind == "journal" and spec.url == str(tmp_path.resolve() / "optuna.journal")
    monkeypatch.setenv("HPSEARCH_STORAGE", "postgresql://env@h/db")
    assert resolve_storage(None, tmp_path).url == "postgresql+psycopg2://env@h/db"
    assert resolve_storage("postgresql://cli@h/db", tmp_path).url.endswith("cli@h/db")
    with pytest.raises(
        StorageError, match=r"--storage: 'mysql://u:\*\*\*@h/db': unsupported scheme"
    ):
        resolve_storage("mysql://u:pw@h/db", tmp_path)
    with pytest.raises(StorageError, match=r"not a storage URL.*ends in \.journal or \.log"):
        resolve_storage("localhost:5432", tmp_path)
    # A port that is not a number: one line, no password.
    for bad in ("postgresql://u:s3cret@h:notaport/db", "postgresql://u:s3cret@[::1/db"):
        with pytest.raises(StorageError, match=r"malformed URL: invalid literal") as info:
            resolve_storage(bad, tmp_path)
        assert "s3cret" not in str(info.value) and "\n" not in str(info.value)
    assert "s3cret" not in redact("mysql://u:s3cret@h:bad/db")


def test_samplers_and_pruners_build() -> None:
    for name in ("tpe", "random", "gp", "cmaes", "nsga2"):
        cfg = load_config("tiny", [f"sampler.name={name}", "sampler.options={}"] + (
            ["pruner.name=none", "pruner.options={}", "objective.metric=[val_acc, train_seconds]",
             "objective.direction=[maximize, minimize]"] if name == "nsga2" else []))  # fmt: skip
        assert make_sampler(cfg) is not None
    for name, cls in (("median", optuna.pruners.MedianPruner),
                      ("asha", optuna.pruners.SuccessiveHalvingPruner),
                      ("hyperband", optuna.pruners.HyperbandPruner),
                      ("none", optuna.pruners.NopPruner)):  # fmt: skip
        opts = ["pruner.options={}"]
        assert isinstance(make_pruner(load_config("tiny", [f"pruner.name={name}", *opts])), cls)


@pytest.mark.parametrize(
    ("choices", "unused"),
    [
        ({}, {"label_smoothing", "focal_gamma"}),  # sgd, ce, crop_flip
        ({"loss": "label_smoothing"}, {"focal_gamma"}),
        ({"loss": "focal", "optimizer": "adamw"}, {"label_smoothing", "momentum"}),
        ({"augment": "flip"}, {"label_smoothing", "focal_gamma", "augment_strength"}),
        ({"augment": "trivial", "loss": "label_smoothing"}, {"focal_gamma"}),
    ],
)
def test_the_values_a_trials_choices_leave_unread(
    choices: dict[str, str], unused: set[str]
) -> None:
    """Not logged to MLflow as the trial's params: a label_smoothing of 0.1 on every run,
    ce and focal ones too, read as if it had taken part (QA)."""
    from hpsearch.config import Hyperparams, unused_hyperparams

    assert unused_hyperparams(Hyperparams(**choices)) == unused


def test_grid_space() -> None:
    cfg = load_config("tiny", [
        "sampler.name=grid", "sampler.options={}",
        "search_space={lr: {type: float, low: 0.1, high: 0.3, step: 0.1}, "
        "batch_size: {type: categorical, choices: [32, 64]}}",
    ])  # fmt: skip
    space = grid_space(cfg)
    assert space["lr"] == [0.1, 0.2, 0.3]  # not 0.30000000000000004, past `high`
    assert space["batch_size"] == [32, 64]
    # A step that does not divide the range: whole steps from low, as Optuna draws them
    # (it shrinks the range to 0.06); not 0.1, which is off the step.
    uneven = load_config("tiny", [
        "sampler.name=grid", "sampler.options={}", "budget.n_trials=2",
        "search_space={lr: {type: float, low: 0.01, high: 0.1, step: 0.05}}",
    ])  # fmt: skip
    assert grid_space(uneven)["lr"] == [0.01, 0.06]
    with pytest.raises(ConfigError, match=r"budget.n_trials: 7: .*grid has 6 points"):
        load_config("tiny", [
            "sampler.name=grid", "sampler.options={}", "budget.n_trials=7",
            "search_space={lr: {type: float, low: 0.1, high: 0.3, step: 0.1}, "
            "batch_size: {type: categorical, choices: [32, 64]}}",
        ])  # fmt: skip


def test_suggest_conditional_params() -> None:
    cfg = load_config("tiny")
    # Sampling, not storage: an in-memory study is the right tool here.
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(30):
        t = study.ask()
        params = suggest(t, cfg)
        seen.add(params["loss"])
        assert ("focal_gamma" in params) == (params["loss"] == "focal")
        assert ("label_smoothing" in params) == (params["loss"] == "label_smoothing")
        study.tell(t, 0.0)
    assert seen == {"ce", "label_smoothing", "focal"}
    hp = cfg.resolve_params({"lr": 0.01})
    assert hp.lr == 0.01 and hp.arch == "resnet18" and hp.augment == "flip"


def test_progress_line_names_input_bound_trials() -> None:
    from hpsearch.launcher import Progress, WorkerView, format_progress

    counts = {"complete": 2, "pruned": 1, "fail": 0, "running": 2, "waiting": 0}
    workers = [WorkerView(0, 11, "0", 5, "running"), WorkerView(1, 12, "0", 6, "running")]
    p = Progress(counts, {6: 31.5}, 10, 0.71, 1, workers, 60.0, 120.0)
    line = format_progress(p)
    assert "complete 2 pruned 1 failed 0 running 2 / 10" in line
    assert "best 0.7100 (trial 1)" in line and "eta 120s" in line
    assert "w0:t5 w1:t6" in line and "input-bound t6 (32% GPU)" in line
    assert "unreachable" not in line
    old = Progress(counts, {}, 10, 0.71, 1, workers, 60.0, 120.0, stale_s=12.4)
    assert format_progress(old).endswith(" | database unreachable: figures 12s old")
    none = Progress(counts, {}, 10, None, None, workers, 3.0, None, stale_s=3.2, never_read=True)
    assert format_progress(none).endswith(" | database unreachable for 3s: nothing read yet")
    # A live worker with no trial is idle, not "running" beside `running 0` (QA).
    idle = [WorkerView(0, 11, "0", None, "running"), WorkerView(1, None, "0", None, "crashed")]
    assert format_progress(Progress(counts, {}, 10, None, None, idle, 1.0, None)).endswith(
        "| eta - | w0:idle w1:crashed"
    )


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_background_threads_yield_the_cpu_to_training() -> None:
    import threading

    from hpsearch.background import NICE, import_in_idle_time, lower_priority

    seen: list[tuple[int, int]] = []

    def background(idle: bool) -> None:
        lower_priority(idle=idle)
        tid = threading.get_native_id()
        seen.append((os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)))

    before = os.getpriority(os.PRIO_PROCESS, 0)
    policy = os.sched_getscheduler(0)
    for idle in (False, True):
        t = threading.Thread(target=background, args=(idle,))
        t.start()
        t.join()
    nice = min(19, before + NICE)
    # A lower share of the CPU; with idle, idle time only: it never takes a training core.
    assert seen == [(nice, policy), (nice, os.SCHED_IDLE)]
    # The training thread keeps its own, also after an import in idle time.
    import_in_idle_time("colorsys")
    assert "colorsys" in sys.modules
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    assert os.sched_getscheduler(0) == policy != os.SCHED_IDLE


def test_pareto_dominance() -> None:
    both = ("maximize", "minimize")  # accuracy up, seconds down
    assert dominates([0.8, 10.0], [0.7, 12.0], both)
    assert dominates([0.8, 10.0], [0.8, 12.0], both)  # equal in one, better in the other
    assert not dominates([0.8, 10.0], [0.8, 10.0], both)  # equal: neither dominates
    assert not dominates([0.9, 20.0], [0.8, 10.0], both)  # a trade-off
    assert not dominates([0.8, 10.0], [0.9, 20.0], both)
    assert dominates([0.1], [0.2], ("minimize",))
    with pytest.raises(ValueError, match="2 objectives"):
        dominates([0.1], [0.2], both)


def test_the_pareto_front_is_optunas_best_trials_by_the_first_objective() -> None:
    """The launch's progress showed `best -` all through a multi-objective study: its best
    is a front (`pareto_front`), which must be the trials Optuna's `best_trials` gives."""
    import random

    from hpsearch.launcher import format_best
    from hpsearch.study import pareto_front

    rng = random.Random(7)
    for directions in (["maximize", "minimize"], ["minimize", "minimize", "maximize"]):
        study = optuna.create_study(directions=directions)
        for _ in range(40):
            values = [float(rng.randint(0, 6)) for _ in directions]  # ties on purpose
            study.add_trial(optuna.trial.create_trial(values=values))
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL))
        front = pareto_front(study.trials, directions)
        assert {t.number for t in front} == {t.number for t in study.best_trials}
        sign = -1.0 if directions[0] == "maximize" else 1.0
        assert front == sorted(front, key=lambda t: (sign * t.values[0], t.number))
    assert pareto_front([], ["maximize", "minimize"]) == []
    assert format_best(0.81234, 4, None) == "0.8123 (trial 4)"
    assert format_best(None, None, (4, 1, 7)) == "pareto 3 (trials 4, 1, 7)"
    assert format_best(None, None, (2,)) == "pareto 1 (trial 2)"
    assert format_best(None, None, tuple(range(7))) == "pareto 7 (trials 0, 1, 2, 3, 4, ...)"
    assert format_best(None, None, ()) == format_best(None, None, None) == "-"


def test_terminal_values() -> None:
    from hpsearch.cli import format_value

    assert format_value(0.123456789) == "0.123457"
    assert format_value([0.5, 12.25]) == "[0.5, 12.25]"
    assert format_value(None) == "-"


def test_resumed_from_is_the_first_epoch_trained_or_the_one_after_the_history() -> None:
    def rec(epoch: int) -> EpochRecord:
        return EpochRecord(epoch, 0.5, 0.5, 0.5, 0.5, 0.1, 1.0, 100.0)

    assert resumed_from_epoch([3, 4, 5], [rec(1), rec(2), rec(3), rec(4), rec(5)]) == 3
    # The checkpoint held every epoch: nothing left to train, it picked up after the last.
    assert resumed_from_epoch([], [rec(1), rec(2), rec(3)]) == 4
    assert resumed_from_epoch([], []) == 1  # no checkpoint and stopped before epoch 1


def test_a_retrys_restored_epochs_without_a_stored_value_are_reported() -> None:
    def rec(epoch: int, val: float | None) -> EpochRecord:
        return EpochRecord(epoch, 1.0, 0.5, None if val is None else 1 - val, val, 0.1, 1.0, 9.0)

    history = [rec(1, 0.2), rec(2, None), rec(3, 0.4), rec(4, 0.5)]  # eval every other epoch
    assert unreported_epochs(history, {1: 0.2, 4: 0.5}) == [(3, 0.4)]
    assert unreported_epochs(history, {1: 0.2, 3: 0.4, 4: 0.5}) == []
    # A study minimizing val_loss is reported its losses (`StudyConfig.reported_metric`).
    assert unreported_epochs(history, {1: 0.8, 4: 0.5}, "val_loss") == [(3, 0.6)]


def test_each_worker_restart_and_resumed_study_draws_from_a_seed_of_its_own() -> None:
    assert sampler_seed(7, 0, 0) == 7  # the first worker of a fresh study: the study's seed
    assert sampler_seed(None, 3, 5) is None  # unseeded stays unseeded
    seeds = {sampler_seed(7, stream, before) for stream in range(8) for before in (0, 4, 40)}
    assert len(seeds) == 24 and all(s is not None and 0 <= s < 2**32 for s in seeds)
    assert sampler_seed(7, 2, 4) == sampler_seed(7, 2, 4)  # reproducible
    assert sampler_seed(7, 1, 0) != sampler_seed(8, 1, 0)  # and follows the study's seed


def test_tries_handed_back_by_a_stop_do_not_use_up_the_crash_retries() -> None:
    """Three Ctrl-C's used up the default retries: the fourth try's epochs were lost."""
    from hpsearch.worker import ATTR_INTERRUPTED_TRIES, retry_callback
    from optuna.trial import TrialState

    # The callback is storage-agnostic: an in-memory study holds the chain.
    study = optuna.create_study()
    callback = retry_callback(1)

    def fail_next(interrupted: bool | None) -> int:
        """Fail the chain's latest try (a stop's, or a crash's); the trials then queued."""
        trial = study.ask()
        trial.report(0.5, 1)
        study.tell(trial, state=TrialState.FAIL)
        frozen = study._storage.get_trial(trial._trial_id)
        if interrupted is None:
            callback(study, frozen)  # a crash: Optuna's own call
        else:
            callback.requeue(study, frozen, interrupted=interrupted)
        return len(study.get_trials(states=(TrialState.WAITING,)))

    study.enqueue_trial({"lr": 0.1})  # the chain's first try
    assert [fail_next(True) for _ in range(4)] == [1, 1, 1, 1]  # every stop: re-queued
    assert fail_next(None) == 1  # the one crash retry --max-retries allows
    assert fail_next(None) == 0  # a second crash ends the chain
    last = study.trials[-1]
    assert last.system_attrs[ATTR_INTERRUPTED_TRIES] == 4
    assert last.system_attrs["retry_history"] == [0, 1, 2, 3, 4]
    assert last.system_attrs["failed_trial"] == 0  # the chain's root: its checkpoint
    assert last.intermediate_values == {1: 0.5}


def test_a_chains_resume_checkpoint_is_named_by_its_first_try(tmp_path: Path) -> None:
    """`trial-<root>.pt` was every study's of that name: a study made again (or of another
    storage) in the same work folder resumed from the other's file, or failed on it."""
    from hpsearch.worker import checkpoint_path

    first = checkpoint_path(tmp_path, "s", 3)
    assert first != checkpoint_path(tmp_path, "s", 3)
    assert first.parent == tmp_path / "checkpoints" / "s"
    assert first.name.startswith("trial-00003-") and first.suffix == ".pt"
    # A retry takes its first try's name, in its own host's work folder; a chain an older
    # version began, the name it recorded.
    other = tmp_path / "host-b"
    assert checkpoint_path(other, "s", 3, str(first)) == other / "checkpoints" / "s" / first.name
    old = "/elsewhere/checkpoints/s/trial-00003.pt"
    assert (
        checkpoint_path(tmp_path, "s", 3, old) == tmp_path / "checkpoints" / "s" / "trial-00003.pt"
    )


def test_finished_trials_give_up_their_resume_checkpoints_and_lesser_best_models() -> None:
    from hpsearch.worker import ATTR_BEST_MODEL, ATTR_CHECKPOINT, checkpoints_to_delete
    from optuna.trial import TrialState, create_trial

    def trial(n: int, state: TrialState, value: float | None) -> optuna.trial.FrozenTrial:
        attrs = {ATTR_CHECKPOINT: f"t{n}.pt", ATTR_BEST_MODEL: f"t{n}.best.pt"}
        t = create_trial(state=state, value=value, user_attrs=attrs)
        t.number = n
        return t

    trials = [
        trial(0, TrialState.COMPLETE, 0.5),
        trial(1, TrialState.COMPLETE, 0.9),
        trial(2, TrialState.PRUNED, None),
        trial(3, TrialState.RUNNING, None),  # may still resume: nothing of it goes
    ]
    assert sorted(checkpoints_to_delete(trials, 1, ["maximize"])) == [
        "t0.best.pt", "t0.pt", "t1.pt", "t2.best.pt", "t2.pt"
    ]  # fmt: skip


def test_a_multi_objective_study_keeps_its_pareto_fronts_best_models() -> None:
    """QA: a multi-objective study kept every trial's best model (45 MB each on tiny) for
    ever: no single ranking. Its front's are kept, whatever keep_top_k is (none with 0): a
    trial off the front never comes back on it. Before that, its resume checkpoints went
    never (disk use grew with every trial)."""
    from hpsearch.worker import ATTR_BEST_MODEL, ATTR_CHECKPOINT, checkpoints_to_delete
    from optuna.trial import TrialState, create_trial

    def trial(n: int, state: TrialState, values: list[float] | None) -> optuna.trial.FrozenTrial:
        attrs = {ATTR_CHECKPOINT: f"t{n}.pt", ATTR_BEST_MODEL: f"t{n}.best.pt"}
        t = create_trial(state=state, values=values, user_attrs=attrs)
        t.number = n
        return t

    trials = [  # (val_acc, train_seconds)
        trial(0, TrialState.COMPLETE, [0.5, 10.0]),  # on the front: the fastest
        trial(1, TrialState.COMPLETE, [0.9, 30.0]),  # on the front: the most accurate
        trial(2, TrialState.COMPLETE, [0.4, 20.0]),  # dominated by 0
        trial(3, TrialState.COMPLETE, [0.7, 20.0]),  # on the front
        trial(4, TrialState.PRUNED, None),
        trial(5, TrialState.RUNNING, None),
    ]
    gone = sorted(checkpoints_to_delete(trials, 1, ["maximize", "minimize"]))
    assert gone == ["t0.pt", "t1.pt", "t2.best.pt", "t2.pt", "t3.pt", "t4.best.pt", "t4.pt"]
    assert "t1.best.pt" in checkpoints_to_delete(trials, 0, ["maximize", "minimize"])


def test_a_trial_failed_for_good_gives_up_its_files_once_no_retry_came() -> None:
    """QA: a trial that failed with no retries left kept its resume checkpoint and best
    model (135 MB on tiny) for ever. Its chain's files go once its last try has failed with
    no retry queued (for `FAILED_FOR_GOOD_AFTER_S`, timed by the worker); a chain a try of
    which still runs or waits keeps them, and a completed retry's best model at the shared
    path is ranked. A handed-back try names its best model: that one goes too (review)."""
    from hpsearch.worker import (
        ATTR_BEST_MODEL,
        ATTR_CHECKPOINT,
        checkpoints_to_delete,
        unretried_failures,
    )
    from optuna.trial import TrialState, create_trial

    def trial(
        n: int, state: TrialState, ckpt: str, history: list[int] | None = None,
        best: bool = False, value: float | None = None,
    ) -> optuna.trial.FrozenTrial:  # fmt: skip
        attrs = {ATTR_CHECKPOINT: ckpt} | (
            {ATTR_BEST_MODEL: ckpt[:-3] + ".best.pt"} if best else {}
        )
        system = {"retry_history": history} if history else {}
        t = create_trial(state=state, value=value, user_attrs=attrs, system_attrs=system)
        t.number = n
        return t

    trials = [
        trial(0, TrialState.FAIL, "a.pt"),  # no retry: failed for good
        trial(1, TrialState.FAIL, "b.pt", best=True),  # handed back; its retry (3) waits
        trial(2, TrialState.FAIL, "c.pt"),  # its retry (4) completed at the same path
        trial(3, TrialState.WAITING, "b.pt", [1]),
        trial(4, TrialState.COMPLETE, "c.pt", [2], best=True, value=0.9),
        trial(5, TrialState.FAIL, "d.pt", [5], best=True),  # (a cached storage's own number)
        trial(6, TrialState.FAIL, "e.pt", best=True),  # handed back, its retry (7) crashed
        trial(7, TrialState.FAIL, "e.pt", [6]),
    ]
    assert unretried_failures(trials) == {0, 5, 7}
    # Not yet seen so long: its retry may still be queued (the stale check's, after an outage).
    assert sorted(checkpoints_to_delete(trials, 1, ["maximize"])) == ["c.pt", "c.pt"]
    assert sorted(checkpoints_to_delete(trials, 1, ["maximize"], {0, 5, 7})) == [
        "a.best.pt", "a.pt", "c.pt", "c.pt", "d.best.pt", "d.pt",
        "e.best.pt", "e.best.pt", "e.pt", "e.pt",
    ]  # fmt: skip
    # The completed retry falls out of the top 1: its best model goes, as any other's.
    trials.append(trial(8, TrialState.COMPLETE, "f.pt", best=True, value=0.95))
    assert "c.best.pt" in checkpoints_to_delete(trials, 1, ["maximize"], {0, 5, 7})


def test_the_best_trial_of_tied_ones_is_the_earliest_everywhere() -> None:
    """Optuna's `best_trial` on PostgreSQL takes any of tied trials: the launch summary and
    the study run's ONNX could name another trial than `hpsearch best` and load_best_model."""
    from hpsearch.study import best_of
    from optuna.study import StudyDirection
    from optuna.trial import TrialState, create_trial

    def trial(
        n: int, value: float | None, state: TrialState = TrialState.COMPLETE
    ) -> optuna.trial.FrozenTrial:
        t = create_trial(state=state, value=value)
        t.number = n
        return t

    trials = [trial(0, 0.5), trial(3, 0.9), trial(2, 0.9), trial(1, None, TrialState.RUNNING)]
    best, low = best_of(trials, StudyDirection.MAXIMIZE), best_of(trials, StudyDirection.MINIMIZE)
    assert best is not None and best.number == 2 and low is not None and low.number == 0
    assert best_of(trials[3:], StudyDirection.MAXIMIZE) is None


def test_cuda_not_available_names_the_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from hpsearch.trainer.trial import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-typo")
    with pytest.raises(DeviceError, match=r"CUDA_VISIBLE_DEVICES='GPU-typo'"):
        resolve_device("cuda")


def test_enqueued_trials_are_queued_once_and_only_while_the_budget_has_room() -> None:
    from hpsearch.study import same_params, trials_to_enqueue
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState, create_trial

    # As Optuna's skip_if_exists: the same names; floats equal within rounding; other values
    # equal and of one type
    assert same_params({"lr": 0.1, "loss": "ce"}, {"loss": "ce", "lr": 0.1 + 1e-17})
    assert not same_params({"lr": 0.1}, {"lr": 0.1, "loss": "ce"})
    assert not same_params({"lr": 0.1}, {"lr": 0.11})
    assert not same_params({"mixup": 1}, {"mixup": True})
    assert not same_params({"batch_size": 64}, {"batch_size": 64.0})

    def trial(state: TrialState, fixed: dict | None = None, lr: float = 0.3) -> object:
        done = state in (TrialState.COMPLETE,)
        return create_trial(
            state=state, value=0.5 if done else None,
            params={"lr": lr} if state != TrialState.WAITING else {},
            distributions={"lr": FloatDistribution(1e-3, 1.0)} if state != TrialState.WAITING else {},
            system_attrs={"fixed_params": fixed} if fixed else {},
        )  # fmt: skip

    a, b, c = {"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3}
    assert trials_to_enqueue([a, b], [], 5) == ([a, b], 0)
    # one the study holds is not queued again: waiting, run (its fixed params), failed,
    # or drawn with the same values
    for held in (trial(TrialState.WAITING, a), trial(TrialState.COMPLETE, a, lr=0.1),
                 trial(TrialState.FAIL, a, lr=0.1), trial(TrialState.COMPLETE, lr=0.1)):  # fmt: skip
        assert trials_to_enqueue([a, b], [held], 5) == ([b], 0)  # type: ignore[list-item]
    # finished, running and queued trials fill the budget; a failed one does not
    four = [trial(TrialState.COMPLETE), trial(TrialState.RUNNING), trial(TrialState.WAITING, c),
            trial(TrialState.FAIL)]  # fmt: skip
    assert trials_to_enqueue([a, b], four, 4) == ([a], 1)  # type: ignore[arg-type]
    assert trials_to_enqueue([a, b, c], four, 3) == ([], 2)  # type: ignore[arg-type]


def test_a_killed_writers_temp_files_are_found_and_a_live_ones_are_not(tmp_path: Path) -> None:
    """A best model's temp file a second Ctrl-C left (35 MB) stayed in the checkpoint
    folder through every later launch."""
    import subprocess
    import sys

    from hpsearch.worker import STALE_TEMP_S, stale_temp_files

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = int(gone.stdout)  # a pid no process has now (reused within a second: unlikely)
    now = 1_000_000.0
    names = {
        "dead_old": f".trial-00006-cc4d9528.best.pt.{dead}.tmp",
        "dead_new": f".trial-00007-cc4d9528.pt.{dead}.tmp",  # another host's live write?
        "mine": f".trial-00008-cc4d9528.pt.{os.getpid()}.tmp",
        "checkpoint": "trial-00006-cc4d9528.pt",
        "other": ".notes.tmp",
        "no_pid": ".trial-00009-cc4d9528.pt.99999999999.tmp",  # os.kill would overflow
    }
    for key, name in names.items():
        (tmp_path / name).write_bytes(b"x")
        age = 1.0 if key == "dead_new" else STALE_TEMP_S + 1
        os.utime(tmp_path / name, (now - age, now - age))
    assert stale_temp_files(tmp_path, now) == [tmp_path / names["dead_old"]]
    assert stale_temp_files(tmp_path / "none", now) == []


def test_a_train_fn_is_looked_for_where_the_workers_look_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: the installed `hpsearch` script's sys.path starts with its own folder, not
    the current one that `python -m` gives the workers: a module beside the user was
    refused. A package's import is never run (a broken one was a raw traceback)."""
    from hpsearch.errors import HpsearchError
    from hpsearch.worker import check_train_fn

    (tmp_path / "mytrain_here.py").write_text("def train(*a):\n    pass\n")
    (tmp_path / "brokenpkg_here").mkdir()
    (tmp_path / "brokenpkg_here" / "__init__.py").write_text("def broken(:\n")
    (tmp_path / "brokenpkg_here" / "sub.py").write_text("def train(*a):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    check_train_fn("mytrain_here:train")
    check_train_fn("brokenpkg_here.sub:train")  # found; its import is the workers' to fail
    assert "brokenpkg_here" not in sys.modules
    check_train_fn("json:loads")  # the standard library
    for spec, said in (
        ("nosuch_here:train", "no module named 'nosuch_here' on the Python path"),
        ("brokenpkg_here.nosub:train", "no module named 'brokenpkg_here.nosub'$"),  # review
        ("mytrain_here.sub:train", "no module named 'mytrain_here.sub'$"),
        ("mytrain_here", "expected MODULE:FUNCTION"),
        ("my-train:train", "'my-train' is not a module name"),
    ):
        with pytest.raises(HpsearchError, match=said):
            check_train_fn(spec)


def test_a_spent_budget_is_said_only_when_nothing_can_change_it() -> None:
    from hpsearch.launcher import spent_note

    base = {"complete": 2, "pruned": 1, "fail": 4, "running": 0, "waiting": 0}
    assert spent_note("s", base, 3) == (
        "study s has 3 finished trials, budget.n_trials is 3: none runs; --trials N (N above "
        "3) runs more"
    )
    assert spent_note("s", base, 4) == ""  # one more to run
    assert spent_note("s", {**base, "waiting": 1}, 3) == ""  # a retry to resume
    assert spent_note("s", {**base, "running": 1}, 3) == ""  # an orphan, failed and resumed


def test_a_gone_workers_trial_has_one_outcome_in_optuna_and_mlflow() -> None:
    """QA and review: a second stop's kill was "failed" in Optuna beside "interrupted" in
    MLflow, and one seen as a death by signal the other way round."""
    from hpsearch.worker import dead_outcome

    assert dead_outcome("worker died (signal 9)") == "failed"
    assert dead_outcome("worker died (signal 9)", interrupted=True) == "interrupted"
    assert dead_outcome("interrupted") == "interrupted"  # killed past the grace
