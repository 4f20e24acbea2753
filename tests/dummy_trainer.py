"""A fast stand-in for hpsearch.trainer.train with the same signature and result type.

Used where the thing under test is the search layer (budgets, concurrency, crashes), not
training. It reports a deterministic curve from the params, checkpoints each epoch as JSON
and resumes from it, and honours report/should_interrupt like the real trainer.
Environment knobs: HPSEARCH_DUMMY_EPOCH_S (seconds per epoch, for crash tests),
HPSEARCH_DUMMY_FINISH_S (seconds after the last epoch, like the real trainer's test pass),
HPSEARCH_DUMMY_AFTER_EPOCH_S (seconds of per-epoch work after the epoch's record, before its
report, like the real trainer's best-weights copy and checkpoint hand-off) and
HPSEARCH_DUMMY_BARRIER="<dir>:<n>" (each process's first trial waits until n processes have
reached it, so a concurrency test really has n trials in flight however slowly they start)
and HPSEARCH_DUMMY_DIE_ONCE="<file>" (the first process to train an epoch makes the file and
kills itself with SIGKILL after that epoch's report), or HPSEARCH_DUMMY_DIE_ONCE_UNREPORTED
="<file>" (the same, right after that epoch's checkpoint, before its report: what a worker
killed while the report's write was still in flight leaves), or
HPSEARCH_DUMMY_POOR_AFTER_FIRST=1 (a process's trials after its first score 0 at every
epoch: a median pruner then prunes them, whatever the sampler proposed, since the view a
trial reports against holds the process's own finished first trial).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from hpsearch.trainer import EpochRecord, TrainOptions, TrialResult

_BARRIER_PASSED = False
_TRIALS_STARTED = 0  # this process's calls of train


def _barrier() -> None:
    global _BARRIER_PASSED
    spec = os.environ.get("HPSEARCH_DUMMY_BARRIER")
    if not spec or _BARRIER_PASSED:
        return
    folder, _, count = spec.rpartition(":")
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 300  # s: 16 cold interpreters on 2 cores take ~60 s
    while len(os.listdir(folder)) < int(count):
        if time.monotonic() > deadline:
            raise TimeoutError(f"dummy barrier: {len(os.listdir(folder))} of {count} arrived")
        time.sleep(0.05)
    _BARRIER_PASSED = True


def _die_once(knob: str = "HPSEARCH_DUMMY_DIE_ONCE") -> None:
    marker = os.environ.get(knob)
    if not marker:
        return
    try:
        open(marker, "x").close()
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def score(params: Mapping[str, Any], epoch: int) -> float:
    lr = float(params.get("lr", 0.1))
    bs = float(params.get("batch_size", 64))
    base = 0.9 - 0.1 * abs(math.log10(lr) + 1.5) - 0.0005 * abs(bs - 64)
    return max(0.0, min(1.0, base * (1 - 0.5**epoch)))


def train(
    config: Any,
    params: Mapping[str, Any],
    report: Callable[[int, float], bool],
    options: TrainOptions | None = None,
) -> TrialResult:
    global _TRIALS_STARTED
    options = options or TrainOptions()
    _barrier()
    _TRIALS_STARTED += 1
    poor = _TRIALS_STARTED > 1 and os.environ.get("HPSEARCH_DUMMY_POOR_AFTER_FIRST") == "1"
    epoch_s = float(os.environ.get("HPSEARCH_DUMMY_EPOCH_S", "0.01"))
    ckpt = options.checkpoint_path
    history: list[EpochRecord] = []
    start = 1
    if ckpt is not None and ckpt.exists():
        state = json.loads(ckpt.read_text())
        history = [EpochRecord(**r) for r in state["history"]]
        start = state["epoch"] + 1
    t0 = time.monotonic()
    reason = "finished"
    pruned_at = None
    for epoch in range(start, config.budget.max_epochs + 1):
        time.sleep(epoch_s)
        acc = 0.0 if poor else score(params, epoch)
        rec = EpochRecord(epoch, 1 - acc, acc, 1 - acc, acc, float(params.get("lr", 0.1)),
                          epoch_s, 1000.0)  # fmt: skip
        history.append(rec)
        if options.on_epoch is not None:
            options.on_epoch(rec)
        # Like the real trainer: no resume checkpoint at the trial's last epoch (it is told
        # next), so a retry always has an epoch left to train.
        if ckpt is not None and epoch < config.budget.max_epochs:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(json.dumps({"epoch": epoch, "history": [r.__dict__ for r in history]}))
            os.replace(tmp, ckpt)
            if options.on_checkpoint is not None:
                options.on_checkpoint(ckpt)
            _die_once("HPSEARCH_DUMMY_DIE_ONCE_UNREPORTED")
        time.sleep(float(os.environ.get("HPSEARCH_DUMMY_AFTER_EPOCH_S", "0")))
        if report(epoch, acc):
            reason, pruned_at = "pruned", epoch
            break
        _die_once()
        if options.should_interrupt is not None and options.should_interrupt():
            reason = "interrupted"
            break
    time.sleep(float(os.environ.get("HPSEARCH_DUMMY_FINISH_S", "0")))
    best = max((r.val_acc for r in history if r.val_acc is not None), default=None)
    return TrialResult(
        history=history,
        best_val_acc=best,
        best_val_loss=None if best is None else 1 - best,
        final_val_acc=history[-1].val_acc if history else None,
        test_acc=best,
        stop_reason=reason,  # type: ignore[arg-type]
        epochs_run=len(history),
        pruned_at_epoch=pruned_at,
        checkpoint_path=ckpt,
        best_model_path=None,
        effective_lr=float(params.get("lr", 0.1)),
        effective_batch_size=int(params.get("batch_size", 64)),
        micro_batch_size=int(params.get("batch_size", 64)),
        train_seconds=time.monotonic() - t0,
        setup_seconds=0.0,
        confusion=None,
        message="",
        num_classes=2,
        class_names=["a", "b"],
    )


def returns_none(config: Any, params: Mapping[str, Any], report: Any, options: Any) -> None:
    """A train function with a bug: it returns nothing."""
    return None


def returns_nan(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """A train function whose objective is NaN (Optuna would store the trial as FAIL)."""
    import dataclasses

    return dataclasses.replace(train(config, params, report, options), best_val_acc=math.nan)


def returns_an_unknown_reason(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """A stop_reason of its own (the trial was COMPLETE in Optuna, FAILED in MLflow)."""
    import dataclasses

    result = train(config, params, report, options)
    return dataclasses.replace(result, stop_reason="done")  # type: ignore[arg-type]


def calls_sys_exit(config: Any, params: Mapping[str, Any], report: Any, options: Any) -> None:
    """A train function that exits (its worker looked crashed, the trial retried as such)."""
    raise SystemExit(3)


def records_tensors(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """Epoch records of numpy and torch scalars, a list of lrs (a scheduler's), no
    effective lr: as a PyTorch user's code hands them on (the tell failed: not JSON)."""
    import dataclasses

    import numpy as np
    import torch

    result = train(config, params, report, options)
    history = [
        dataclasses.replace(r, val_acc=torch.tensor(r.val_acc), train_loss=np.float32(r.train_loss),
                            lr=[r.lr])  # type: ignore[arg-type]
        for r in result.history
    ]  # fmt: skip
    return dataclasses.replace(result, history=history, effective_lr=None)  # type: ignore[arg-type]


_CALLS = [0]


def fails_every_other(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """A study where some trials hit an error now and then (a parameter region a layer
    refuses), the others train."""
    _CALLS[0] += 1
    if _CALLS[0] % 2:
        raise RuntimeError("Expected more than 1 value per channel when training")
    return train(config, params, report, options)


def waits_out_gpu_memory(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """A trial whose wait for room on its GPU ran out (the ledger's admission, which wraps
    the train function in the worker)."""
    from hpsearch.packing import AdmissionStopped

    raise AdmissionStopped("waited 3600 s for room beside the trials packed there")


def finished_elsewhere_meanwhile(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """Trains while another worker's stale check fails this trial (this worker cut off from
    the database for longer than the heartbeat grace): every RUNNING trial of the study in
    the journal that HPSEARCH_DUMMY_JOURNAL names is failed before the result returns."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    result = train(config, params, report, options)
    storage = JournalStorage(JournalFileBackend(os.environ["HPSEARCH_DUMMY_JOURNAL"]))
    study = optuna.load_study(study_name=config.name, storage=storage)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    return result


def time_limit_before_eval(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """A trial whose time limit came before its first evaluation: no value to tell."""
    import dataclasses

    return dataclasses.replace(
        train(config, params, lambda epoch, value: False, options),
        best_val_acc=None, best_val_loss=None, final_val_acc=None, test_acc=None,
        stop_reason="time_limit", history=[],
    )  # fmt: skip


def database_gone_after_an_epoch(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """The database stays down past the worker's limit during the trial's second epoch
    (its report's write gives up), after its MLflow run started."""
    from hpsearch.errors import StorageError

    report(1, 0.5)
    if options is not None and options.on_epoch is not None:
        options.on_epoch(EpochRecord(1, 0.5, 0.5, 0.5, 0.5, 0.1, 0.01, 1000.0))
    time.sleep(3.0)  # s: the run's create answered meanwhile
    raise StorageError("report: database unreachable for 120s: connection refused")


def failed_elsewhere_then_reports(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """The stale check of another worker fails this trial while it trains (this worker was
    stopped, or cut off), and its next epoch's report then finds it finished."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    report(1, 0.1)
    storage = JournalStorage(JournalFileBackend(os.environ["HPSEARCH_DUMMY_JOURNAL"]))
    study = optuna.load_study(study_name=config.name, storage=storage)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    report(2, 0.2)
    return train(config, params, report, options)


def tells_its_own_study_twice(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """A train_fn's own bug whose error reads like a trial finished elsewhere."""
    raise ValueError("Cannot tell a COMPLETE trial.")


def disk_full_after_an_epoch(
    config: Any, params: Mapping[str, Any], report: Any, options: TrainOptions | None = None
) -> TrialResult:
    """Reports epoch 1, then its checkpoint finds no room (as the real trainer's atomic_save
    raises it): the trial is no fault of its own."""
    from hpsearch.errors import DiskFullError

    report(1, 0.1)
    raise DiskFullError("checkpoint /w/t.pt: not written: no space left on device (3 MiB free, "
                        "45 MiB to write); none was there before", 45 << 20)  # fmt: skip
