"""train(): learning on real data, stop reasons, resume, checkpoints, OOM."""

from __future__ import annotations

import dataclasses
import errno
import itertools
import math
import time
import types
from pathlib import Path
from typing import Any

import hpsearch.trainer.trial as train_module
import pytest
import torch
from disk_util import remount, tmpfs
from hpsearch.errors import DeviceError
from hpsearch.trainer import (
    CheckpointError,
    EpochRecord,
    TrainOptions,
    TrialResult,
    WarmCache,
    evaluate_model,
    load_trained_model,
    train,
)
from torch import nn
from trainer_helpers import make_config, synthetic

TINY = {"batch_size": 16, "lr": 0.05, "arch": "resnet18"}


RAN: list[bool] = []


def _run_on_load() -> None:
    RAN.append(True)


class _Hook:
    """Unpickled by calling `_run_on_load`: what a crafted model file does."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_run_on_load, ())


def numbers(history: list[EpochRecord]) -> list[tuple[Any, ...]]:
    """Everything of an epoch record except wall-clock figures."""
    return [(r.epoch, r.train_loss, r.train_acc, r.val_loss, r.val_acc, r.lr) for r in history]


@pytest.mark.slow
def test_resnet18_learns_flowers102(flowers_root: Path, cache_workdir: Path) -> None:
    """All 102 classes, the official 1020 training images at 32 px, 2 epochs: far above the
    1/102 chance level. The best model on disk gives back the logged accuracy."""
    cfg = make_config(
        {"name": "flowers102", "root": str(flowers_root), "image_size": 32, "eval_limit": 306},
        budget={"max_epochs": 2},
        trainer={"seed": 0},
    )
    params = {"batch_size": 32, "lr": 0.05, "warmup_epochs": 0.5}
    seen: list[EpochRecord] = []
    ckpt = cache_workdir / "trials" / "flowers.pt"
    result = train(
        cfg,
        params,
        options=TrainOptions(
            device="cpu", workdir=cache_workdir, checkpoint_path=ckpt, on_epoch=seen.append
        ),
    )
    assert result.stop_reason == "finished", result.message
    assert result.num_classes == 102 and len(result.class_names) == 102
    assert seen == result.history and result.epochs_run == 2
    assert result.best_val_acc is not None and result.best_val_acc > 5 / 102, result.history
    assert result.test_acc is not None and result.test_acc > 3 / 102
    assert result.history[-1].train_loss < result.history[0].train_loss
    assert result.setup_seconds > 0 and result.train_seconds > 0
    # confusion of the best model: rows true classes, trace = correct predictions
    conf = torch.tensor(result.confusion)
    assert conf.shape == (102, 102) and conf.sum() == 306
    assert conf.trace().item() / 306 == pytest.approx(result.best_val_acc)
    # the saved best model evaluates to the logged best accuracy
    assert result.best_model_path is not None and result.best_model_path.is_file()
    model = load_trained_model(cfg, params, result.best_model_path)
    assert not model.training
    # The file names its architecture: a study relaunched with another default still loads
    # it (resnet34's layers would not take these weights: load_state_dict raises).
    defaults = cfg.trainer.defaults.model_copy(update={"arch": "resnet34"})
    other = cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"defaults": defaults})}
    )
    assert other.resolve_params(params).arch == "resnet34"
    again = load_trained_model(
        other, params, result.best_model_path, device=torch.device("cpu")
    )  # a torch.device, as PyTorch users pass one
    assert len(list(again.parameters())) == len(list(model.parameters()))
    # A damaged file, or one that names code to run when unpickled (from a shared MLflow
    # server), is refused in one line and runs nothing.
    bad = result.best_model_path.with_name("bad.best.pt")
    for content in (b"", b"not a torch file"):
        bad.write_bytes(content)
        with pytest.raises(CheckpointError, match="not a readable hpsearch model file"):
            load_trained_model(cfg, params, bad)
    torch.save({"model": model.state_dict(), "num_classes": 102, "hook": _Hook()}, bad)
    with pytest.raises(CheckpointError, match="UnpicklingError"):
        load_trained_model(cfg, params, bad)
    assert not RAN
    acc, loss = evaluate_model(cfg, params, model, "val", cache_workdir)
    assert acc == result.best_val_acc
    assert loss == pytest.approx(result.best_val_loss, rel=1e-5)
    # One's own images: the model's transform and class names classify as the trial's
    # evaluation did (QA: the README said neither; a guessed transform scored 0.2, not 0.5).
    from hpsearch.trainer import data
    from PIL import Image

    assert model.class_names == result.class_names
    src = data.get_source(cfg, "val")
    assert src is not None
    with torch.inference_mode():
        preds = []
        for path in src.items:
            with Image.open(path) as image:
                preds.append(int(model(model.transform(image).unsqueeze(0)).argmax(1)))
    own = float((torch.tensor(preds) == torch.from_numpy(src.labels)).float().mean())
    assert abs(own - acc) <= 3 / len(src), (own, acc)  # JPEG draft decoding differs slightly


def test_pruning_stops_at_that_epoch(tmp_path: Path) -> None:
    cfg = synthetic(budget={"max_epochs": 4})
    calls: list[tuple[int, float]] = []

    def report(epoch: int, value: float) -> bool:
        calls.append((epoch, value))
        return epoch == 2

    result = train(cfg, TINY, report, TrainOptions(device="cpu", workdir=tmp_path))
    assert result.stop_reason == "pruned" and result.pruned_at_epoch == 2
    assert result.epochs_run == 2 and [c[0] for c in calls] == [1, 2]
    assert calls[-1][1] == result.history[-1].val_acc and 0 <= calls[-1][1] <= 1
    assert result.test_acc is None


def test_pruned_trial_writes_no_best_model(tmp_path: Path) -> None:
    """A pruned trial never ranks among the study's best and its files are deleted once it
    is told: its best model is not written (nor waited for before the tell)."""
    cfg = synthetic(budget={"max_epochs": 3})
    ckpt = tmp_path / "ckpt" / "t.pt"
    opts = TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt)
    pruned = train(cfg, TINY, lambda e, v: e == 1, opts)
    assert pruned.stop_reason == "pruned" and pruned.best_val_acc is not None
    assert pruned.best_model_path is None and not any(ckpt.parent.glob("*"))
    finished = train(cfg, TINY, lambda e, v: False, opts)  # the same options keep it
    assert finished.best_model_path is not None and finished.best_model_path.is_file()


def test_on_checkpoint_sees_the_save_just_written(tmp_path: Path) -> None:
    """The hook runs once each resume checkpoint is on disk (what an upload must take), with
    the file holding that epoch, not the previous one; a stop's last save included."""
    cfg = synthetic(budget={"max_epochs": 3})
    ckpt = tmp_path / "ckpt" / "t.pt"
    seen: list[int] = []

    def hook(path: Path) -> None:
        assert path == ckpt
        seen.append(int(torch.load(path, weights_only=False)["epoch"]))

    opts = TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt, on_checkpoint=hook)
    full = train(cfg, TINY, lambda e, v: False, opts)
    # The last epoch ends the trial (no save); epoch 2's save, written while epoch 3 trains,
    # is given up if it is not on disk when the trial ends (nothing resumes a finished one).
    assert full.stop_reason == "finished" and seen in ([1], [1, 2])
    seen.clear()
    ckpt.unlink(missing_ok=True)
    epochs: list[int] = []
    stop = dataclasses.replace(
        opts, on_epoch=lambda r: epochs.append(r.epoch), should_interrupt=lambda: bool(epochs)
    )
    spaced = synthetic(budget={"max_epochs": 3}, trainer={"checkpoint_every_s": 3600})
    stopped = train(spaced, TINY, lambda e, v: False, stop)  # saved only because it stops
    assert stopped.stop_reason == "interrupted" and seen == [1]


def test_eval_every_and_patience(tmp_path: Path) -> None:
    cfg = synthetic(
        budget={"max_epochs": 3}, trainer={"eval_every": 2, "patience": 1, "evaluate_test": True}
    )
    reports: list[int] = []
    result = train(
        cfg,
        {**TINY, "lr": 1e-7, "schedule": "constant", "warmup_epochs": 0},
        lambda e, v: reports.append(e) is not None,
        TrainOptions(device="cpu", workdir=tmp_path),
    )
    # evals at epoch 2 and at the last epoch; lr ~ 0: no progress, so the second eval is no
    # better -> early stop
    assert [r.val_acc is not None for r in result.history] == [False, True, True]
    assert reports == [2, 3]
    assert result.stop_reason == "early_stopped" and "early stopped" in result.message
    assert result.test_acc is not None  # a complete trial: tested with its best model


def test_divergence_then_next_trial_works(tmp_path: Path) -> None:
    cfg = synthetic()
    opts = TrainOptions(device="cpu", workdir=tmp_path)
    bad = train(cfg, {**TINY, "lr": 1e12, "warmup_epochs": 0}, options=opts)
    assert bad.stop_reason == "diverged"
    assert "loss is nan" in bad.message or "loss is inf" in bad.message
    assert "epoch 1 step" in bad.message
    good = train(cfg, TINY, options=opts)
    assert good.stop_reason == "finished" and good.epochs_run == 2
    assert all(r.train_loss == r.train_loss for r in good.history)  # not NaN


def test_weights_broken_by_an_epochs_last_step_are_not_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A last step with a finite loss and non-finite gradients leaves NaN weights that no
    step of the epoch shows: the validation loss does, and the pruner is not given it. A
    NaN loss from sound weights (fp16 logits past its range on one image) is no divergence:
    the epoch counts, its loss as inf."""
    real = train_module.evaluate

    def overflowing(*args: Any, **kwargs: Any) -> Any:
        acc, _, confusion = real(*args, **kwargs)
        return acc, math.nan, confusion

    def breaking(fwd: Any, *args: Any, **kwargs: Any) -> Any:
        next(fwd.parameters()).data.fill_(math.nan)  # what the epoch's last step did
        return real(fwd, *args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", breaking)
    reports: list[int] = []
    result = train(synthetic(), TINY, lambda e, v: bool(reports.append(e)),
                   TrainOptions(device="cpu", workdir=tmp_path))  # fmt: skip
    assert result.stop_reason == "diverged" and "validation loss is nan" in result.message
    assert reports == [] and result.best_model_path is None

    monkeypatch.setattr(train_module, "evaluate", overflowing)
    result = train(synthetic(), TINY, lambda e, v: bool(reports.append(e)),
                   TrainOptions(device="cpu", workdir=tmp_path))  # fmt: skip
    assert result.stop_reason == "finished" and reports == [1, 2]
    assert [r.val_loss for r in result.history] == [math.inf, math.inf]
    # Where the loss is an objective, Optuna takes no inf: such an epoch is never the best,
    # though its accuracy is higher; the trial goes on.
    calls: list[int] = []

    def second_overflows(*args: Any, **kwargs: Any) -> Any:
        acc, loss, confusion = real(*args, **kwargs)
        calls.append(1)
        return (0.99, math.nan, confusion) if len(calls) == 2 else (acc, loss, confusion)

    monkeypatch.setattr(train_module, "evaluate", second_overflows)
    by_loss = synthetic(objective={"metric": ["val_acc", "val_loss"]}, pruner={"name": "none"})
    result = train(by_loss, TINY, options=TrainOptions(device="cpu", workdir=tmp_path))
    assert result.stop_reason == "finished" and result.best_val_acc != 0.99  # epoch 1's
    assert result.best_val_loss is not None and math.isfinite(result.best_val_loss)
    monkeypatch.setattr(train_module, "evaluate", overflowing)  # every epoch: nothing to tell
    result = train(by_loss, TINY, options=TrainOptions(device="cpu", workdir=tmp_path))
    assert result.stop_reason == "diverged" and "no evaluated epoch" in result.message


def test_a_dataset_the_gpu_cannot_hold_streams_instead_of_failing_the_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fast_path=auto checks the decoded size against max_cache_mb, not the GPU's room: an
    upload that runs out of memory was reported as the trial's batch size running out,
    and the sampler learned that every value fails. The split streams from the CPU."""
    real = train_module._decoded_to_device
    uploads: list[int] = []

    failing = {2}  # uploads that find the GPU full: the val split's

    def upload(dec: Any, device: Any) -> Any:
        uploads.append(len(dec.labels))
        if len(uploads) in failing:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.80 GiB")
        return real(dec, device)

    monkeypatch.setattr(train_module, "_decoded_to_device", upload)
    cfg = synthetic(dataset={"fast_path": "auto"},
                    trainer={"evaluate_test": False, "num_workers": 0})  # fmt: skip
    warm = train_module.WarmCache()
    opts = TrainOptions(device="cpu", workdir=tmp_path, warm=warm)
    with pytest.warns(UserWarning, match="val split does not fit in GPU memory"):
        result = train(cfg, TINY, options=opts)
    assert result.stop_reason == "finished" and result.epochs_run == 2, result.message
    # Not tried again: the cache held only this trial's train split, which stays in use.
    assert len(uploads) == 2 and warm.data == {}
    # A GPU that has room once the cached copies (another image size's) are given up
    # takes the split after all.
    uploads.clear()
    warm.put_data(("other", "size"), torch.zeros(1))
    result = train(cfg, TINY, options=opts)
    assert result.stop_reason == "finished" and len(uploads) == 3
    assert ("other", "size") not in warm.data
    assert any("val" in key for key in warm.data)  # on the device after all


def test_a_checkpoint_of_other_optimizer_groups_resumes_with_a_fresh_optimizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint from before ConvNeXt's layer_scale left the decayed group: its optimizer
    state no longer fits, and every retry of the trial failed on it."""
    import hpsearch.trainer.optim as optim

    cfg = synthetic(budget={"max_epochs": 2})
    ckpt = tmp_path / "t.pt"
    epochs: list[int] = []
    opts = TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt,
                        on_epoch=lambda r: epochs.append(r.epoch),
                        should_interrupt=lambda: len(epochs) >= 1)  # fmt: skip
    assert train(cfg, TINY, options=opts).stop_reason == "interrupted"
    real = optim.param_groups
    monkeypatch.setattr(optim, "param_groups", lambda m, wd: real(m, wd)[:1])  # one group
    with pytest.warns(UserWarning, match="resumed with a fresh one"):
        resumed = train(cfg, TINY, options=dataclasses.replace(opts, should_interrupt=None))
    assert resumed.stop_reason == "finished" and resumed.epochs_run == 2


def test_auto_precision_takes_bf16_only_where_it_is_native(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch counts emulated bf16 as supported (a T4, a V100): fp16 runs faster there."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation)  # fmt: skip
    assert train_module.resolve_precision("auto", torch.device("cuda")) == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert train_module.resolve_precision("auto", torch.device("cuda")) == torch.bfloat16
    from hpsearch.errors import HpsearchWarning

    with pytest.warns(HpsearchWarning, match=r"^trainer.precision: fp16 needs CUDA; using fp32"):
        assert train_module.resolve_precision("fp16", torch.device("cpu")) is None


class _OOMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_is_a_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_module, "build_model", lambda cfg, hp, n: _OOMModel())
    result = train(
        synthetic(),
        {**TINY, "batch_size": 32},
        options=TrainOptions(device="cpu", workdir=tmp_path),
    )
    assert result.stop_reason == "out_of_memory"
    assert "out of memory at batch_size=32" in result.message
    assert result.epochs_run == 0 and result.best_val_acc is None
    monkeypatch.undo()
    assert (
        train(synthetic(), TINY, options=TrainOptions(device="cpu", workdir=tmp_path)).stop_reason
        == "finished"
    )


class _WorkspaceErrorModel(nn.Module):
    """Raises what cuDNN raises when it cannot get a workspace: a plain RuntimeError."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)
        self.text = text

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(self.text)


def test_a_library_allocation_failure_is_out_of_memory_and_a_bug_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDNN and cuBLAS report a failed allocation as RuntimeError, not OutOfMemoryError: the
    trial ends out_of_memory (the sampler learns the batch does not fit) with the cause in
    its message; any other RuntimeError is a bug and raised, for the worker to record."""
    alloc = "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"
    wrapped = f"backend='inductor' raised:\nRuntimeError: {alloc}\n\nSet TORCH_LOGS for more"
    monkeypatch.setattr(
        train_module, "build_model", lambda cfg, hp, n: _WorkspaceErrorModel(wrapped)
    )
    result = train(synthetic(), TINY, options=TrainOptions(device="cpu", workdir=tmp_path))
    assert result.stop_reason == "out_of_memory" and result.epochs_run == 0
    assert result.message == (
        f"out of memory at batch_size=16 (micro-batch 16, resnet18 at 16 px): RuntimeError: {alloc}"
    )
    # a bug, and cuDNN's INTERNAL_ERROR, which a device-side assert can surface as
    for bug in (
        "CUDA error: an illegal memory access was encountered",
        "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR",
    ):
        monkeypatch.setattr(
            train_module, "build_model", lambda cfg, hp, n, bug=bug: _WorkspaceErrorModel(bug)
        )
        with pytest.raises(RuntimeError, match=bug.split(": ")[1]):
            train(synthetic(), TINY, options=TrainOptions(device="cpu", workdir=tmp_path))


def test_same_seed_same_history_and_seed_matters(tmp_path: Path) -> None:
    cfg = synthetic(budget={"max_epochs": 1})
    params = {**TINY, "augment": "trivial", "mixup_alpha": 0.2}
    a = train(cfg, params, options=TrainOptions(device="cpu", workdir=tmp_path, seed=3))
    b = train(cfg, params, options=TrainOptions(device="cpu", workdir=tmp_path, seed=3))
    c = train(cfg, params, options=TrainOptions(device="cpu", workdir=tmp_path, seed=4))
    assert numbers(a.history) == numbers(b.history)
    assert numbers(a.history) != numbers(c.history)


def interrupted_after(
    n: int, cfg: Any, params: dict[str, Any], ckpt: Path, epochs: list[int]
) -> TrialResult:
    """Train until `n` epochs are done, then stop as Ctrl-C would: the resume checkpoint at
    `ckpt` holds them. `epochs` collects the epochs trained."""
    result = train(
        cfg,
        params,
        options=TrainOptions(
            device="cpu",
            workdir=ckpt.parent,
            checkpoint_path=ckpt,
            on_epoch=lambda r: epochs.append(r.epoch),
            should_interrupt=lambda: len(epochs) >= n,
        ),
    )
    assert result.stop_reason == "interrupted" and result.epochs_run == n
    return result


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    cfg = synthetic(budget={"max_epochs": 2})
    params = {**TINY, "augment": "randaugment", "cutmix_alpha": 1.0, "schedule": "onecycle"}
    full = train(
        cfg,
        params,
        options=TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=tmp_path / "full.pt"),
    )
    ckpt = tmp_path / "part.pt"
    epochs: list[int] = []
    first = interrupted_after(1, cfg, params, ckpt, epochs)
    assert first.checkpoint_path == ckpt and ckpt.is_file()
    resumed = train(
        cfg,
        params,
        options=TrainOptions(
            device="cpu",
            workdir=tmp_path,
            checkpoint_path=ckpt,
            on_epoch=lambda r: epochs.append(r.epoch),
        ),
    )
    assert epochs == [1, 2]  # history continues at epoch 2
    assert resumed.stop_reason == "finished"
    assert numbers(resumed.history) == numbers(full.history)
    assert resumed.best_val_acc == full.best_val_acc
    assert resumed.confusion == full.confusion
    a = torch.load(full.best_model_path, weights_only=False)["model"]
    b = torch.load(resumed.best_model_path, weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_equals_uninterrupted_on_the_streaming_path_with_loader_workers(
    tmp_path: Path,
) -> None:
    """The DataLoader drew its workers' base seed from torch's global generator in the first
    epoch a process trains: a resumed run's dropout masks differed from the uninterrupted
    run's from the epoch it resumed at (MobileNetV3 has dropout)."""
    cfg = synthetic(
        dataset={"fast_path": "off"},
        budget={"max_epochs": 2},
        trainer={"num_workers": 1, "evaluate_test": False, "precision": "fp32"},
    )
    params = {**TINY, "arch": "mobilenet_v3_small", "augment": "flip", "schedule": "constant"}
    full = train(cfg, params, options=TrainOptions(device="cpu", workdir=tmp_path, seed=7))
    ckpt = tmp_path / "part.pt"
    epochs: list[int] = []
    interrupted = train(cfg, params, options=TrainOptions(
        device="cpu", workdir=tmp_path, checkpoint_path=ckpt, seed=7,
        on_epoch=lambda r: epochs.append(r.epoch), should_interrupt=lambda: len(epochs) >= 1,
    ))  # fmt: skip
    assert interrupted.stop_reason == "interrupted"
    resumed = train(cfg, params, options=TrainOptions(
        device="cpu", workdir=tmp_path, checkpoint_path=ckpt, seed=7,
    ))  # fmt: skip
    assert numbers(resumed.history) == numbers(full.history)


def test_a_resumed_run_reports_its_last_restored_epoch_first_and_may_be_pruned_there(
    tmp_path: Path,
) -> None:
    """A try that died between an epoch's checkpoint and its report's write left that value
    out of the study: the resumed run reports its last restored epoch again before it
    trains, and the pruner's answer to it may stop the run there."""
    cfg = synthetic(budget={"max_epochs": 3})
    ckpt = tmp_path / "t.pt"
    first = interrupted_after(2, cfg, TINY, ckpt, [])
    again = tmp_path / "again.pt"
    again.write_bytes(ckpt.read_bytes())
    restored = [(r.epoch, r.val_acc) for r in first.history]

    calls: list[tuple[int, float]] = []
    trained: list[int] = []

    def resume(path: Path, stop_at: int | None) -> Any:
        calls.clear()
        trained.clear()

        def report(epoch: int, value: float) -> bool:
            calls.append((epoch, value))
            return epoch == stop_at

        on_epoch = lambda r: trained.append(r.epoch)  # noqa: E731
        options = TrainOptions(
            device="cpu", workdir=tmp_path, checkpoint_path=path, on_epoch=on_epoch
        )
        return train(cfg, TINY, report, options)

    going = resume(ckpt, None)
    assert calls[0] == restored[-1] and [c[0] for c in calls] == [2, 3]
    assert trained == [3] and going.stop_reason == "finished"
    pruned = resume(again, 2)  # the pruner stops it at the epoch its try never reported
    assert calls == restored[-1:] and trained == []
    assert pruned.stop_reason == "pruned" and pruned.pruned_at_epoch == 2
    assert pruned.epochs_run == 2 and pruned.test_acc is None


def test_checkpoint_interval_saves_at_the_end_and_when_a_stop_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer.checkpoint_every_s spaces resume checkpoints out; a requested stop is always
    saved. A trial that ends writes only its best model (nothing would resume from it)."""
    saved: list[tuple[str, Any]] = []
    real = train_module.atomic_save

    def spy(obj: Any, path: Path, drop: Any = None) -> bool:
        saved.append((path.name, obj.get("epoch")))
        return bool(real(obj, path, drop))

    monkeypatch.setattr(train_module, "atomic_save", spy)
    cfg = synthetic(
        budget={"max_epochs": 3},
        trainer={"evaluate_test": False, "checkpoint_every_s": 3600},
    )
    ckpt = tmp_path / "t.pt"
    result = train(cfg, TINY, options=TrainOptions(device="cpu", workdir=tmp_path,
                                                   checkpoint_path=ckpt))  # fmt: skip
    assert [e for name, e in saved if name == "t.pt"] == []
    assert not ckpt.exists()
    assert result.best_model_path is not None and result.best_model_path.is_file()
    best = torch.load(result.best_model_path, weights_only=False)
    assert best["val_acc"] == result.best_val_acc

    saved.clear()
    calls = {"n": 0}

    def stop_after_first_epoch() -> bool:  # polled before each epoch and at its end
        calls["n"] += 1
        return calls["n"] >= 2

    ckpt2 = tmp_path / "t2.pt"
    stopped = train(cfg, TINY, options=TrainOptions(
        device="cpu", workdir=tmp_path, checkpoint_path=ckpt2,
        should_interrupt=stop_after_first_epoch,
    ))  # fmt: skip
    assert stopped.stop_reason == "interrupted" and stopped.epochs_run == 1
    assert [e for name, e in saved if name == "t2.pt"] == [1]

    # a stop first seen before an epoch starts still saves the epochs trained since
    calls["n"] = 0

    def stop_before_third_epoch() -> bool:  # calls: before e1, after e1, before e2, ...
        calls["n"] += 1
        return calls["n"] >= 5

    ckpt3 = tmp_path / "t3.pt"
    late = train(cfg, TINY, options=TrainOptions(
        device="cpu", workdir=tmp_path, checkpoint_path=ckpt3,
        should_interrupt=stop_before_third_epoch,
    ))  # fmt: skip
    assert late.stop_reason == "interrupted" and late.epochs_run == 2
    assert [e for name, e in saved if name == "t3.pt"] == [2]
    assert torch.load(ckpt3, weights_only=False)["epoch"] == 2


def test_a_trial_that_ends_after_a_failed_resume_checkpoint_keeps_its_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: epoch 1's writes found the disk full; epoch 2, the last, was the best, and
    its best-model write raised that earlier error: a trial trained to its end was handed
    back as if cut off. Its last writes go on; its value stands. (Epoch 1's best-model
    write fails here: a resume checkpoint still being written is given up at the end.)"""
    real_save = torch.save
    failed: list[int] = []

    def disk_full_once(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(obj, dict) and "optimizer" not in obj and not failed:
            failed.append(obj["epoch"])
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_once)
    _scripted_evaluate(monkeypatch, [0.3, 0.6])
    ckpt = tmp_path / "t.pt"
    result = train(synthetic(budget={"max_epochs": 2}), TINY,
                   options=TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt))  # fmt: skip
    assert failed == [1] and result.stop_reason == "finished" and result.best_val_acc == 0.6
    assert result.best_model_path is not None
    assert torch.load(result.best_model_path, weights_only=False)["epoch"] == 2


def test_failed_checkpoint_write_keeps_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "trial.pt"
    real_save = torch.save
    calls = {"n": 0}

    def disk_full(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(obj, dict) and "optimizer" in obj:
            calls["n"] += 1
            if calls["n"] == 2:  # the end-of-epoch-2 checkpoint
                f.write(b"partial")
                raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(
        CheckpointError, match=r"no space left on device.*the previous one is intact"
    ):
        train(  # 4 epochs: epoch 3's save waits for epoch 2's (one that ends the trial won't)
            synthetic(budget={"max_epochs": 4}),
            TINY,
            options=TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt),
        )
    kept = torch.load(ckpt, weights_only=False)
    assert kept["epoch"] == 1 and len(kept["history"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tmp") == []


def test_a_checkpoint_write_cut_short_by_a_full_disk_leaves_no_temp_file(
    tmp_path: Path,
) -> None:
    """torch.save reports a failed write as a RuntimeError of its C++ writer, not an
    OSError: it went through as a bug, and the part-written temp file (a 45 MB best model)
    stayed and kept the disk full. The full disk here is a file size limit in a child."""
    import subprocess
    import sys

    code = f"""
import resource, signal, torch
from pathlib import Path
from hpsearch.trainer.trial import atomic_save
from hpsearch.errors import CheckpointError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
try:
    atomic_save({{"w": torch.zeros(1_000_000)}}, Path({str(tmp_path / "x.pt")!r}))
except CheckpointError as exc:
    print("CheckpointError:", exc)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "CheckpointError: checkpoint" in r.stdout and "write failed" in r.stdout, r.stderr
    assert len(r.stdout.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_on_a_full_or_read_only_disk_says_so_in_words(tmp_path: Path) -> None:
    """QA: torch's writer reports a full disk as "[enforce fail at inline_container.cc:672]
    . unexpected pos 25917312 vs 25917208", which the worker log, the MLflow reason and
    `train`'s error showed as it came, with "the previous checkpoint is intact" where there
    was none. A real 8 MiB tmpfs here (mounted as root, as CI runs)."""

    from hpsearch.errors import DiskFullError

    with tmpfs(tmp_path / "disk", "8M") as disk:
        big = {"w": torch.zeros(3_000_000)}  # 12 MB of float32
        with pytest.raises(DiskFullError, match=(
            r"t.pt: not written: no space left on device \(\d MiB free, 11 MiB to write\); "
            r"none was there before$"
        )):  # fmt: skip
            train_module.atomic_save(big, disk / "t.pt")
        assert list(disk.iterdir()) == []  # no temp file keeps the disk full
        train_module.atomic_save({"w": torch.zeros(10)}, disk / "t.pt")
        with pytest.raises(DiskFullError, match=r"no space left on .*the previous one is intact$"):
            train_module.atomic_save(big, disk / "t.pt")
        remount(disk, "ro")
        with pytest.raises(DiskFullError, match=r"t.pt: not written: its disk is read-only"):
            train_module.atomic_save({"w": torch.zeros(10)}, disk / "t.pt")


def test_a_dropped_resume_checkpoint_keeps_the_previous_one_and_the_best_model(
    tmp_path: Path,
) -> None:
    """A trial that ends while its resume checkpoint is being written gives that write up
    half-way: the previous file stays whole, no temp file is left, the hook is not called;
    the best model, written first, is written in full."""
    writer = train_module._CheckpointWriter()
    ckpt, best = tmp_path / "t.pt", tmp_path / "t.best.pt"
    train_module.atomic_save({"epoch": 1}, ckpt)
    done: list[int] = []

    class EndsTheTrial:  # pickled while the checkpoint is being written
        def __reduce__(self) -> tuple[Any, ...]:
            writer.drop()
            return (dict, ())

    state = {"epoch": 2, "end": EndsTheTrial(), "weights": torch.zeros(1000)}
    writer.submit(
        [({"model": {"w": torch.ones(3)}}, best), (state, ckpt)],
        lambda: done.append(1),
        droppable=ckpt,
    )
    writer.wait()
    assert torch.load(ckpt, weights_only=False) == {"epoch": 1}
    assert torch.equal(torch.load(best, weights_only=False)["model"]["w"], torch.ones(3))
    assert done == [] and sorted(p.name for p in tmp_path.iterdir()) == ["t.best.pt", "t.pt"]
    # Once dropped, a later resume checkpoint of the same writer is not written at all.
    writer.submit([({"epoch": 3}, ckpt)], lambda: done.append(1), droppable=ckpt)
    writer.wait()
    assert torch.load(ckpt, weights_only=False) == {"epoch": 1} and done == []


def test_a_trial_that_ended_gives_up_its_resume_checkpoint_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epoch 2's resume checkpoint is held up until it is given up: a finished trial gives
    it up at its end (the file keeps epoch 1; it would be deleted unread after the tell),
    an interrupted one waits for it (a retry resumes from it)."""
    real = train_module.atomic_save
    hold = {"s": 30.0}  # how long epoch 2's save waits to be given up
    given_up: list[bool] = []

    def slow(obj: Any, path: Path, drop: Any = None) -> bool:
        if drop is not None and obj.get("epoch") == 2:
            given_up.append(drop.wait(hold["s"]))
        return bool(real(obj, path, drop))

    monkeypatch.setattr(train_module, "atomic_save", slow)
    cfg = synthetic(budget={"max_epochs": 3}, trainer={"checkpoint_every_s": 0})
    ckpt = tmp_path / "t.pt"
    opts = TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt)
    finished = train(cfg, TINY, lambda e, v: False, opts)
    # Given up half-way, or not begun: the best model before it took long enough.
    assert finished.stop_reason == "finished" and given_up in ([True], [])
    assert torch.load(ckpt, weights_only=False)["epoch"] == 1
    assert finished.best_model_path is not None and finished.best_model_path.is_file()

    given_up.clear()
    hold["s"] = 1.0
    ckpt.unlink()
    epochs: list[int] = []
    stop = dataclasses.replace(opts, on_epoch=lambda r: epochs.append(r.epoch),
                               should_interrupt=lambda: len(epochs) >= 2)  # fmt: skip
    stopped = train(cfg, TINY, lambda e, v: False, stop)
    assert stopped.stop_reason == "interrupted" and given_up == [False]
    assert torch.load(ckpt, weights_only=False)["epoch"] == 2 and stopped.checkpoint_path == ckpt


def _skewed_clock(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """The trainer's clock, ahead of time.perf_counter by `skew["s"]` seconds (set by the
    test): a time limit falls where the test wants it whatever this machine's speed."""
    skew = {"s": 0.0}
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + skew["s"])
    monkeypatch.setattr(train_module, "time", clock)
    return skew


def test_time_limit(tmp_path: Path) -> None:
    cfg = synthetic(budget={"max_epochs": 50, "trial_timeout_s": 0.5})
    result = train(cfg, TINY, options=TrainOptions(device="cpu", workdir=tmp_path))
    assert result.stop_reason == "time_limit" and "time limit" in result.message
    assert result.epochs_run < 50


def test_a_trial_stopped_by_its_time_limit_gets_the_test_accuracy_of_its_best_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It is told COMPLETE with its best val_acc and may be the study's best trial."""
    # The trainer's clock runs 100 s ahead per epoch: the limit falls in epoch 3 whatever
    # this machine's speed.
    skew = _skewed_clock(monkeypatch)
    cfg = synthetic(budget={"max_epochs": 50, "trial_timeout_s": 150.0},
                    trainer={"evaluate_test": True})  # fmt: skip
    opts = TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=tmp_path / "t.pt",
                        on_epoch=lambda r: skew.update(s=skew["s"] + 100.0))  # fmt: skip
    result = train(cfg, TINY, options=opts)
    assert result.stop_reason == "time_limit" and result.epochs_run == 2
    assert result.test_acc is not None and result.best_model_path is not None
    model = load_trained_model(cfg, TINY, result.best_model_path)
    assert evaluate_model(cfg, TINY, model, "val", tmp_path)[0] == result.best_val_acc
    assert evaluate_model(cfg, TINY, model, "test", tmp_path)[0] == result.test_acc


def test_a_limit_passed_between_epochs_trains_no_step_of_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skew = _skewed_clock(monkeypatch)
    real = train_module.train_batches
    epochs: list[int] = []

    def batches(split: Any, batch_size: int, seed: int, epoch: int, device: Any) -> Any:
        epochs.append(epoch)
        return real(split, batch_size, seed, epoch, device)

    monkeypatch.setattr(train_module, "train_batches", batches)
    cfg = synthetic(budget={"max_epochs": 3, "trial_timeout_s": 500.0})
    opts = TrainOptions(device="cpu", workdir=tmp_path,
                        on_epoch=lambda r: skew.update(s=1000.0))  # fmt: skip
    result = train(cfg, TINY, options=opts)
    assert result.stop_reason == "time_limit" and "before epoch 2" in result.message
    assert epochs == [1] and result.epochs_run == 1


def test_an_epoch_the_time_limit_falls_in_after_its_last_step_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit passing in the last step of the last epoch: that epoch is whole, so it is
    evaluated and the trial finished (it was dropped, and the trial ended time_limit)."""
    skew = _skewed_clock(monkeypatch)
    real = train_module.train_batches

    def batches(split: Any, batch_size: int, seed: int, epoch: int, device: Any) -> Any:
        items = list(real(split, batch_size, seed, epoch, device))
        for k, item in enumerate(items):
            if epoch == 2 and k == len(items) - 1:
                skew["s"] += 1000.0  # the limit passes during this, the epoch's last step
            yield item

    monkeypatch.setattr(train_module, "train_batches", batches)
    cfg = synthetic(budget={"max_epochs": 2, "trial_timeout_s": 500.0})
    result = train(cfg, TINY, options=TrainOptions(device="cpu", workdir=tmp_path))
    assert result.stop_reason == "finished" and result.epochs_run == 2, result.message
    assert result.history[-1].val_acc is not None


def test_a_resumed_trial_counts_its_earlier_tries_against_its_time_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each try had the whole trial_timeout_s again: a trial interrupted and resumed trained
    past its limit."""
    skew = _skewed_clock(monkeypatch)  # 100 s ahead per epoch
    cfg = synthetic(budget={"max_epochs": 50, "trial_timeout_s": 150.0})
    epochs: list[int] = []

    def report(epoch: int, value: float) -> bool:  # before the epoch's checkpoint
        if epoch not in reported:  # not the resumed try's report of its restored epoch
            reported.add(epoch)
            skew["s"] += 100.0
        return False

    reported: set[int] = set()

    opts = TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=tmp_path / "t.pt",
                        on_epoch=lambda r: epochs.append(r.epoch),
                        should_interrupt=lambda: len(epochs) == 1)  # fmt: skip
    first = train(cfg, TINY, report, opts)
    assert first.stop_reason == "interrupted" and first.epochs_run == 1  # 100 s used
    resumed = train(cfg, TINY, report, dataclasses.replace(opts, should_interrupt=None))
    # 100 s + epoch 2's 100 s: the limit falls in epoch 3 (a fresh 150 s: in epoch 4).
    assert resumed.stop_reason == "time_limit" and resumed.epochs_run == 2, resumed.message


def test_streaming_path_equals_fast_path(tmp_path: Path) -> None:
    """Same shuffle, same crops, same augmentation: the two data paths train identically."""
    params = {**TINY, "augment": "crop_flip"}
    runs = []
    for mode in ("on", "off"):
        cfg = synthetic(
            dataset={"fast_path": mode, "train_limit": 48},
            budget={"max_epochs": 1},
            trainer={"num_workers": 1},
        )
        runs.append(train(cfg, params, options=TrainOptions(device="cpu", workdir=tmp_path)))
    assert numbers(runs[0].history) == numbers(runs[1].history)


def _no_batchnorm_model(cfg: Any, hp: Any, num_classes: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


def test_gradient_accumulation_matches_full_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks 11 + 11 + 10 weighted by their share give the full batch's gradient (a model
    without BatchNorm, whose batch statistics would differ by design)."""
    monkeypatch.setattr(train_module, "build_model", _no_batchnorm_model)
    params = {**TINY, "augment": "crop_flip", "batch_size": 32, "lr": 0.5}
    opts = TrainOptions(device="cpu", workdir=tmp_path)
    full = train(synthetic(), params, options=opts)
    acc = train(
        synthetic(trainer={"max_micro_batch": 12, "evaluate_test": False}), params, options=opts
    )
    assert (acc.micro_batch_size, acc.effective_batch_size) == (11, 32)
    for a, b in zip(numbers(full.history), numbers(acc.history), strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    assert full.history[1].train_loss != full.history[0].train_loss  # it did train


def test_a_train_split_smaller_than_one_batch_trains_in_chunks_batchnorm_takes(
    tmp_path: Path,
) -> None:
    """6 images for a batch of 16 in chunks of at most 2: 3 chunks of 2 (8 chunks of 1 or 0
    images would make BatchNorm raise)."""
    cfg = synthetic(
        dataset={"train_limit": 6}, trainer={"max_micro_batch": 2, "base_batch_size": 64}
    )
    params = {**TINY, "lr_scaling": "linear", "lr": 0.1}
    result = train(cfg, params, options=TrainOptions(device="cpu", workdir=tmp_path))
    assert result.stop_reason == "finished" and result.micro_batch_size == 2
    # The batch is the 6 images, not 16: the lr was scaled for 16, and 16 was reported.
    assert result.effective_batch_size == 6
    assert result.effective_lr == pytest.approx(0.1 * 6 / 64)
    assert all(math.isfinite(r.train_loss) for r in result.history)


def test_lr_scaling_and_result_fields(tmp_path: Path) -> None:
    cfg = synthetic(
        budget={"max_epochs": 1}, trainer={"base_batch_size": 64, "evaluate_test": True}
    )
    r = train(
        cfg,
        {**TINY, "lr_scaling": "linear", "lr": 0.1},
        options=TrainOptions(device="cpu", workdir=tmp_path, warm=WarmCache()),
    )
    assert r.effective_lr == pytest.approx(0.025)  # 0.1 x 16 / 64
    assert r.effective_batch_size == 16 and r.micro_batch_size == 16
    assert r.test_acc is not None and r.checkpoint_path is None and r.best_model_path is None
    assert dataclasses.asdict(r)["history"][0]["epoch"] == 1


def test_cuda_without_cuda_is_device_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        train(synthetic(), TINY, options=TrainOptions(device="cuda", workdir=tmp_path))


# --- from a review of the trainer ------------------------------------------------------------


def test_a_warm_model_reused_after_a_failed_step_starts_with_no_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trial out of memory between two micro-batches left its gradients on the cached
    compiled model; the next trial of the same shapes added its first step's to them."""
    monkeypatch.setattr(torch, "compile", lambda m, **k: m)  # the warm path, without inductor
    calls = {"n": 0, "oom_at": 2}
    real_make_loss = train_module.make_loss

    def make_loss(hp: Any) -> Any:
        loss = real_make_loss(hp)

        def counted(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            if calls["n"] == calls["oom_at"]:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return loss(logits, target)

        return counted

    monkeypatch.setattr(train_module, "make_loss", make_loss)
    cfg = synthetic(trainer={"compile": True, "max_micro_batch": 8})
    params = {**TINY, "augment": "flip"}
    warm = WarmCache()

    def run(cache: WarmCache) -> TrialResult:
        return train(cfg, params, options=TrainOptions(device="cpu", workdir=tmp_path, warm=cache))

    assert run(warm).stop_reason == "out_of_memory"  # the second micro-batch of step 1
    # Its gradients are freed with the trial, not held on the cached model until its reuse.
    cached, _ = next(iter(warm.models.values()))
    assert all(p.grad is None for p in cached.parameters())
    calls["oom_at"] = -1
    reused, fresh = run(warm), run(WarmCache())
    assert numbers(reused.history) == numbers(fresh.history)


def test_a_study_minimizing_val_loss_reports_val_loss(tmp_path: Path) -> None:
    """The pruner compares reports in the study's direction: val_acc reported to a study
    minimizing val_loss pruned the most accurate trials."""
    for objective, metric in (
        ({"metric": "val_loss", "direction": "minimize"}, "val_loss"),
        ({"metric": "val_acc", "direction": "maximize"}, "val_acc"),
    ):
        reported: list[tuple[int, float]] = []
        result = train(
            synthetic(objective=objective),
            TINY,
            report=lambda epoch, value, seen=reported: seen.append((epoch, value)) is not None,
            options=TrainOptions(device="cpu", workdir=tmp_path),
        )
        assert reported == [(r.epoch, getattr(r, metric)) for r in result.history]


def test_the_best_epoch_is_the_objectives_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A study minimizing val_loss scored each trial by the val loss of its most accurate
    epoch, and kept (and tested) that epoch's weights, not the lowest loss's."""
    scripted = iter([(0.5, 2.0), (0.4, 1.0), (0.6, 3.0)] * 3)  # (val_acc, val_loss) by epoch

    def evaluate(*args: Any, **kwargs: Any) -> Any:
        acc, loss = next(scripted)
        return acc, loss, torch.zeros(10, 10, dtype=torch.long)

    monkeypatch.setattr(train_module, "evaluate", evaluate)
    for objective, best_epoch in (
        ({"metric": "val_loss", "direction": "minimize"}, 2),
        ({"metric": "val_acc", "direction": "maximize"}, 3),
        # Beside train_seconds too: its told loss was the most accurate epoch's.
        ({"metric": ["val_loss", "train_seconds"]}, 2),
    ):
        ckpt = tmp_path / f"{'-'.join(objective['metric'])}.pt"
        cfg = synthetic(objective=objective, budget={"max_epochs": 3}, pruner={"name": "none"})
        result = train(cfg, TINY, options=TrainOptions(device="cpu", workdir=tmp_path,
                                                       checkpoint_path=ckpt))  # fmt: skip
        acc, loss = {2: (0.4, 1.0), 3: (0.6, 3.0)}[best_epoch]
        assert (result.best_val_acc, result.best_val_loss) == (acc, loss)
        assert result.best_model_path is not None
        assert torch.load(result.best_model_path, weights_only=False)["epoch"] == best_epoch


def _scripted_evaluate(monkeypatch: pytest.MonkeyPatch, accs: list[float]) -> None:
    scripted = iter(accs)

    def evaluate(*args: Any, **kwargs: Any) -> Any:
        acc = next(scripted)
        return acc, 1.0 - acc, torch.zeros(10, 10, dtype=torch.long)

    monkeypatch.setattr(train_module, "evaluate", evaluate)


def _disk_full_at_best_model_of(monkeypatch: pytest.MonkeyPatch, epoch: int) -> None:
    """torch.save of the best-model file of `epoch` fails: the disk is full."""
    real_save = torch.save

    def disk_full(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(obj, dict) and obj.get("epoch") == epoch and "optimizer" not in obj:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full)


def test_a_failed_last_best_model_write_keeps_the_trained_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk filled up as the best model of a trained trial's last epoch was written:
    the whole trial was lost (raised, told FAIL). Its result stands, without a best-model
    file: the one there held an earlier epoch, not the best."""
    _scripted_evaluate(monkeypatch, [0.5, 0.6])  # epoch 2 is the best
    _disk_full_at_best_model_of(monkeypatch, epoch=2)
    ckpt = tmp_path / "trial.pt"
    result = train(synthetic(), TINY,
                   options=TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt))  # fmt: skip
    assert result.stop_reason == "finished" and result.epochs_run == 2
    assert result.best_val_acc == 0.6
    assert "not saved" in result.message and "no space left on device (" in result.message
    assert result.best_model_path is None
    assert not train_module.best_model_path_for(ckpt).exists()


def test_an_interrupted_trials_failed_write_keeps_the_older_pair_it_resumes_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after epoch 2, whose best model's write failed: the epoch-1 checkpoint and
    best model on disk belong together, and the retry resumes from them."""
    _scripted_evaluate(monkeypatch, [0.5, 0.6])
    _disk_full_at_best_model_of(monkeypatch, epoch=2)
    ckpt = tmp_path / "trial.pt"
    stop = itertools.chain([False] * 3, itertools.repeat(True))  # asked for after epoch 2
    result = train(synthetic(budget={"max_epochs": 3}), TINY,
                   options=TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt,
                                        should_interrupt=lambda: next(stop)))  # fmt: skip
    assert result.stop_reason == "interrupted" and "not saved" in result.message
    assert result.checkpoint_path == ckpt and result.best_model_path is not None
    assert torch.load(ckpt, weights_only=False)["epoch"] == 1
    assert torch.load(result.best_model_path, weights_only=False)["epoch"] == 1


def test_a_best_model_newer_than_the_resume_checkpoint_is_not_taken_for_the_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after the best model of epoch 2 was written and before its checkpoint: the
    retry trains epoch 2 again, which may not be the best this time, and reported epoch
    1's accuracy with epoch 2's weights as its best model (its test pass, ONNX, loads)."""
    ckpt = tmp_path / "trial.pt"
    cfg = synthetic(budget={"max_epochs": 3})
    _scripted_evaluate(monkeypatch, [0.5])
    stop = itertools.chain([False], itertools.repeat(True))  # stop after epoch 1
    first = train(cfg, TINY, options=TrainOptions(device="cpu", workdir=tmp_path,
                                                 checkpoint_path=ckpt,
                                                 should_interrupt=lambda: next(stop)))  # fmt: skip
    assert first.stop_reason == "interrupted" and first.best_model_path is not None
    best = torch.load(first.best_model_path, weights_only=False)
    torch.save({**best, "epoch": 2, "val_acc": 0.55}, first.best_model_path)  # the crash's
    _scripted_evaluate(monkeypatch, [0.4, 0.3])  # epoch 2 this time: no better than 1
    second = train(cfg, TINY,
                   options=TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt))  # fmt: skip
    assert second.best_val_acc == 0.5 and second.stop_reason == "finished"
    assert second.best_model_path is None and not first.best_model_path.exists()


def test_a_damaged_resume_checkpoint_is_one_line(tmp_path: Path) -> None:
    ckpt = tmp_path / "trial.pt"
    ckpt.write_bytes(b"PK\x03\x04 not a whole zip")
    with pytest.raises(CheckpointError) as info:
        train(synthetic(), TINY,
              options=TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt))  # fmt: skip
    msg = str(info.value)
    assert msg.startswith(f"checkpoint {ckpt}: cannot resume from it (") and "\n" not in msg
    assert msg.endswith("delete it to start the trial afresh")


class _EvalOutOfMemory(nn.Module):
    """Inference on more than `limit` images runs out of memory; training fits."""

    def __init__(self, inner: nn.Module, limit: int) -> None:
        super().__init__()
        self.inner, self.limit = inner, limit
        self.raised = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and x.shape[0] > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.inner(x)


def test_an_evaluation_out_of_memory_takes_the_training_batch_not_the_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of 256 eval images ran out of memory where the training batch of 16 fit: the
    trial was told out of memory at batch_size=16, which the sampler learned to avoid."""
    cfg = synthetic(trainer={"evaluate_test": True})
    plain = train(cfg, TINY, options=TrainOptions(device="cpu", workdir=tmp_path))
    real_build = train_module.build_model
    built: list[_EvalOutOfMemory] = []

    def build(c: Any, hp: Any, n: int) -> nn.Module:
        built.append(_EvalOutOfMemory(real_build(c, hp, n), limit=16))
        return built[-1]

    monkeypatch.setattr(train_module, "build_model", build)
    fitted = train(cfg, TINY, options=TrainOptions(device="cpu", workdir=tmp_path))
    assert built[0].raised == 1  # the later evaluations (epoch 2, test) take the batch that fit
    assert fitted.stop_reason == "finished", fitted.message
    assert [r.val_acc for r in fitted.history] == [r.val_acc for r in plain.history]
    assert [r.val_loss for r in fitted.history] == pytest.approx(
        [r.val_loss for r in plain.history]
    )
    assert fitted.test_acc == plain.test_acc is not None


def test_out_of_memory_in_the_test_pass_keeps_the_trained_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test split goes onto the device after training: running out of memory there
    threw a finished trial away as out_of_memory (told pruned, marked infeasible)."""
    cfg = synthetic(budget={"max_epochs": 1}, trainer={"evaluate_test": True})
    real_evaluate = train_module.evaluate
    calls: list[int] = []

    def evaluate(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) >= 2:  # after the one validation: the test pass, in both batch sizes
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", evaluate)
    result = train(cfg, TINY, options=TrainOptions(device="cpu", workdir=tmp_path))
    assert len(calls) == 3
    assert result.stop_reason == "finished" and result.best_val_acc is not None
    assert result.test_acc is None and "test accuracy not measured" in result.message


def test_a_resumed_run_follows_a_larger_epoch_budget(tmp_path: Path) -> None:
    """A relaunch with a larger budget.max_epochs resumed the old schedule's total steps:
    the epochs past it trained at lr 0."""
    params = {**TINY, "schedule": "onecycle"}
    ckpt = tmp_path / "part.pt"
    interrupted_after(1, synthetic(budget={"max_epochs": 2}), params, ckpt, [])
    longer = synthetic(budget={"max_epochs": 4})
    resumed = train(
        longer, params, options=TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=ckpt)
    )
    fresh = train(longer, params, options=TrainOptions(device="cpu", workdir=tmp_path / "f"))
    assert [r.epoch for r in resumed.history] == [1, 2, 3, 4]
    assert [r.lr for r in resumed.history[1:]] == [r.lr for r in fresh.history[1:]]
    assert resumed.history[2].lr > 0


def test_eval_flip_averages_the_logits_of_each_image_and_its_mirror() -> None:
    """Accuracy and cross-entropy of the mean logits; a model that tells an image from its
    mirror scores otherwise without the flip."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5))
    images = torch.randint(0, 256, (12, 3, 4, 4), dtype=torch.uint8)
    labels = torch.randint(0, 5, (12,))
    split = train_module.Split(n=12, labels=labels, eval_images=images)
    x = train_module.augment.normalize(images)
    with torch.no_grad():
        mean = (model(x) + model(x.flip(3))) / 2
    dev = torch.device("cpu")
    acc, loss, _ = train_module.evaluate(model, split, 4, 5, dev, None, False, batch=5, flip=True)
    assert acc == pytest.approx((mean.argmax(1) == labels).float().mean().item())
    assert loss == pytest.approx(nn.functional.cross_entropy(mean, labels).item(), rel=1e-6)
    plain = train_module.evaluate(model, split, 4, 5, dev, None, False, batch=5)
    assert plain[1] != pytest.approx(loss, rel=1e-6)


def test_eval_scale_and_flip_evaluate_val_and_test_at_their_size(tmp_path: Path) -> None:
    """val and test at the trial's size x eval_scale (the warm cache holds them at that size),
    with the mirror; the best model file gives the logged figures back through
    evaluate_model, which applies both."""
    cfg = synthetic(
        dataset={"cache_size": 20},
        trainer={"evaluate_test": True, "eval_flip": True, "eval_scale": 1.25},
    )
    warm = WarmCache()
    opts = TrainOptions(device="cpu", workdir=tmp_path, checkpoint_path=tmp_path / "t.pt",
                        warm=warm)  # fmt: skip
    result = train(cfg, TINY, options=opts)
    assert {k[-1] for k in warm.data if "eval" in k} == {20}  # 16 px x 1.25
    assert result.best_model_path is not None and result.test_acc is not None
    model = load_trained_model(cfg, TINY, result.best_model_path)
    assert evaluate_model(cfg, TINY, model, "val", tmp_path)[0] == result.best_val_acc
    assert evaluate_model(cfg, TINY, model, "test", tmp_path)[0] == result.test_acc
