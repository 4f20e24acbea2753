"""The worker's per-trial timing line splits the trainer's call into set-up, epochs and the
finish (test pass and the best model's write), so a benchmark can tell where a trial's time
went outside its training loop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from hpsearch.config import load_config
from hpsearch.storage import StorageSpec
from hpsearch.worker import WorkerOptions, run_worker


def _timing(workdir: Path) -> dict[str, Any]:
    line = (workdir / "timings" / "w0.jsonl").read_text().splitlines()[0]
    return json.loads(line)  # type: ignore[no-any-return]


def test_timing_split_of_a_known_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 epochs of 0.2 s, each with 1.0 s of work after its record (checkpoint hand-off,
    # best-weights copy), then 2.0 s after the last epoch (the real trainer's test pass).
    # Long enough that the last after-epoch work counted in the finish (or the finish in
    # the epochs) is told apart from a loaded machine's scheduling delays.
    monkeypatch.setenv("HPSEARCH_DUMMY_EPOCH_S", "0.2")
    monkeypatch.setenv("HPSEARCH_DUMMY_AFTER_EPOCH_S", "1.0")
    monkeypatch.setenv("HPSEARCH_DUMMY_FINISH_S", "2.0")
    cfg = load_config("tiny", overrides=["budget.n_trials=1", "budget.max_epochs=3"])
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    opts = WorkerOptions(workdir=tmp_path, worker_id="w0", train_fn="dummy_trainer:train")
    assert run_worker(cfg, spec, opts).outcomes == {"finished": 1}
    t = _timing(tmp_path)
    assert (t["study"], t["trial"]) == ("tiny", 0)  # (QA: two studies' workers share a file)
    assert 3.6 <= t["epochs_s"] < 3.6 + 0.9  # the per-epoch work belongs to the epochs
    assert 2.0 <= t["finish_s"] < 2.0 + 0.9
    assert t["setup_s"] == 0.0  # the dummy reports none
    assert t["epochs_s"] + t["finish_s"] <= t["trial_s"]


def test_timing_split_of_the_real_trainer(tmp_path: Path, flowers_root: Path) -> None:
    """The real trainer calls the epoch callbacks last in each epoch, so the finish is the
    test pass and the best model's write, and the epochs hold at least their own seconds."""
    cfg = load_config(
        "tiny",
        overrides=["budget.n_trials=1", "budget.max_epochs=1", "trainer.evaluate_test=true"],
        data_dir=str(flowers_root),
    )
    journal = tmp_path / "optuna.journal"
    spec = StorageSpec("journal", str(journal), "journal")
    opts = WorkerOptions(workdir=tmp_path, worker_id="w0", device="cpu")
    assert run_worker(cfg, spec, opts).outcomes == {"finished": 1}
    t = _timing(tmp_path)
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))
    )
    trial = optuna.load_study(study_name=cfg.name, storage=storage).trials[0]
    assert trial.user_attrs.get("test_acc") is not None
    epoch_seconds = sum(r["epoch_seconds"] for r in trial.user_attrs["history"])
    assert epoch_seconds <= t["epochs_s"] < epoch_seconds + 1.0
    assert t["setup_s"] > 0 and t["finish_s"] > 0
    assert t["setup_s"] + t["epochs_s"] + t["finish_s"] <= t["trial_s"]


def test_a_first_try_never_resumes_from_another_same_name_studys_file(tmp_path: Path) -> None:
    """Every study named `tiny` kept trial 0's resume checkpoint at `trial-00000.pt`: a study
    made again in the work folder (another storage, or the old one deleted) found the other's
    file there and failed on its hyperparameters, or resumed from its weights."""
    import torch

    left = tmp_path / "checkpoints" / "tiny" / "trial-00000.pt"
    left.parent.mkdir(parents=True)
    torch.save({"params": {"lr": 123.0}, "epoch": 1}, left)
    cfg = load_config(
        "tiny",
        overrides=["budget.n_trials=1", "budget.max_epochs=1", "dataset.name=synthetic",
                   "dataset.image_size=16", "trainer.evaluate_test=false"],
    )  # fmt: skip
    spec = StorageSpec("journal", str(tmp_path / "optuna.journal"), "journal")
    opts = WorkerOptions(workdir=tmp_path, worker_id="w0", device="cpu")
    assert run_worker(cfg, spec, opts).outcomes == {"finished": 1}
    assert torch.load(left, weights_only=False)["params"] == {"lr": 123.0}  # left alone
