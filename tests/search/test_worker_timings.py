"""The worker's per-trial timing line splits the trainer's call into set-up, epochs and the
finish (test pass and the best model's write), so a benchmark can tell where a trial's time
went outside its training loop."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from hpsearch.config import load_config
from hpsearch.storage import StorageSpec
from hpsearch.worker import WorkerOptions, run_worker


def test_timing_line_splits_the_trainers_call(tmp_path: Path, flowers_root: Path) -> None:
    cfg = load_config(
        "tiny",
        overrides=["budget.n_trials=1", "budget.max_epochs=2", "trainer.evaluate_test=true"],
        data_dir=str(flowers_root),
    )
    journal = tmp_path / "optuna.journal"
    spec = StorageSpec("journal", str(journal), "journal")
    opts = WorkerOptions(workdir=tmp_path, worker_id="w0", device="cpu")
    summary = run_worker(cfg, spec, opts)
    assert summary.outcomes == {"finished": 1}

    timing = json.loads((tmp_path / "timings" / "w0.jsonl").read_text().splitlines()[0])
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))
    )
    trial = optuna.load_study(study_name=cfg.name, storage=storage).trials[0]
    history = trial.user_attrs["history"]
    assert timing["epochs_s"] == pytest.approx(sum(r["epoch_seconds"] for r in history), rel=1e-6)
    assert timing["setup_s"] > 0
    # the test split was evaluated after the last epoch: the finish is not empty
    assert trial.user_attrs.get("test_acc") is not None
    assert timing["finish_s"] > 0
    whole = timing["setup_s"] + timing["epochs_s"] + timing["finish_s"]
    assert whole <= timing["trial_s"]
    assert whole > 0.5 * timing["trial_s"]  # the trainer's call is most of a trial
