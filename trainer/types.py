"""The trainer's data types, importable without torch (workers and tools that only
exchange results stay light)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hpsearch.errors import CheckpointError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "NOT_SAVED",
    "NO_ROOM",
    "RESOURCE_ERROR_MARKERS",
    "CheckpointError",
    "EpochRecord",
    "Report",
    "StopReason",
    "TrainOptions",
    "TrialResult",
    "WarmCache",
    "is_resource_error",
    "resource_error_cause",
    "unsaved_note",
]

# A trial's message says so of a write of its end that failed (its result stands, without
# that file): `not saved: <file> (<why>)`.
NOT_SAVED = "not saved: "
# The words `atomic_save` gives a write that found no room: a full disk, a quota, read-only.
NO_ROOM = ("no space left on device", "disk quota exceeded", "its disk is read-only")


def unsaved_note(message: str | None) -> str | None:
    """The `not saved: ...` part of a trial's message, or None."""
    at = (message or "").find(NOT_SAVED)
    return None if at < 0 or message is None else message[at:]


# What CUDA and its libraries raise, as RuntimeError, when a batch needs more memory or
# workspace than the device has: out of memory in the allocator or a library's own
# allocation, and cuDNN's status for a configuration it cannot run (some large-batch
# convolutions). A trial that meets one ends out_of_memory (the batch does not fit).
RESOURCE_ERROR_MARKERS = (
    "out of memory",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUFFT_ALLOC_FAILED",
)


def is_resource_error(
    exc: BaseException, markers: tuple[str, ...] = RESOURCE_ERROR_MARKERS
) -> bool:
    """Whether a RuntimeError from a training step is the device running out of memory or
    workspace (a smaller batch may work), rather than a bug."""
    text = str(exc)
    return any(marker in text for marker in markers)


def resource_error_cause(
    exc: BaseException, markers: tuple[str, ...] = RESOURCE_ERROR_MARKERS
) -> str:
    """The line of the error's text that names what ran out (a wrapped error, such as a
    compile failure, names it on a later line), at most 200 characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    hit = next((line for line in lines if any(m in line for m in markers)), "")
    return hit[:200]


Report = Callable[[int, float], bool]  # report(epoch, val_acc) -> True: stop now (pruned)
StopReason = Literal[
    "finished", "pruned", "early_stopped", "diverged", "out_of_memory", "time_limit", "interrupted"
]


@dataclass(frozen=True)
class EpochRecord:
    epoch: int  # 1-based
    train_loss: float  # mean training loss over the epoch (with the trial's loss function)
    train_acc: float  # fraction of training images whose argmax matches the (main) label
    val_loss: float | None  # cross-entropy on val; None on epochs without eval
    val_acc: float | None
    lr: float  # at the end of the epoch
    epoch_seconds: float  # train + eval wall clock
    images_per_second: float  # training images / training seconds


@dataclass(frozen=True)
class TrialResult:
    history: list[EpochRecord]
    best_val_acc: float | None
    # Val loss at the best epoch: the best val_acc's, or the lowest where val_loss is the
    # objective (StudyConfig.reported_metric); best_val_acc is that epoch's accuracy.
    best_val_loss: float | None
    final_val_acc: float | None
    test_acc: float | None
    stop_reason: StopReason
    epochs_run: int
    pruned_at_epoch: int | None
    checkpoint_path: Path | None
    best_model_path: Path | None
    effective_lr: float
    effective_batch_size: int
    micro_batch_size: int
    train_seconds: float
    setup_seconds: float  # before the first epoch: data, model, compile
    confusion: list[list[int]] | None  # val confusion of the best model, rows true
    message: str
    num_classes: int
    class_names: list[str]


@dataclass
class WarmCache:
    """Reused across trials in one worker process: device-resident datasets and compiled
    models keyed by (arch, resolution, batch, ...). Not thread-safe; one per process."""

    data: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    models: dict[tuple[Any, ...], tuple[nn.Module, nn.Module]] = field(default_factory=dict)
    max_data_entries: int = 8
    # Compiled models held between trials: each keeps its weights and compiled code on the
    # device, outside any trial's memory reservation, so a study searching many (arch,
    # resolution, batch) keeps only the most recently used few.
    max_models: int = 4

    def put_data(self, key: tuple[Any, ...], value: Any) -> None:
        self.data[key] = value
        while len(self.data) > self.max_data_entries:
            self.data.pop(next(iter(self.data)))  # oldest first

    def get_model(self, key: tuple[Any, ...]) -> tuple[nn.Module, nn.Module] | None:
        """The compiled (model, forward) for `key`, now the most recently used; or None."""
        entry = self.models.pop(key, None)
        if entry is not None:
            self.models[key] = entry
        return entry

    def put_model(self, key: tuple[Any, ...], entry: tuple[nn.Module, nn.Module]) -> None:
        self.models[key] = entry
        while len(self.models) > self.max_models:
            self.models.pop(next(iter(self.models)))  # least recently used first

    def clear(self) -> None:
        self.data.clear()
        self.models.clear()


@dataclass(frozen=True)
class TrainOptions:
    device: str = "auto"  # auto|cpu|cuda|cuda:N
    workdir: Path = Path(".hpsearch")  # the data cache lives in workdir/cache/
    checkpoint_path: Path | None = None  # written every epoch; resumed from when present
    seed: int | None = None  # None: config.trainer.seed
    on_epoch: Callable[[EpochRecord], None] | None = None
    warm: WarmCache | None = None
    should_interrupt: Callable[[], bool] | None = None  # polled between epochs
    # Called with checkpoint_path on the writer thread once a resume checkpoint is on disk
    # (the file then holds that save, not the previous one); exceptions are only warned of.
    on_checkpoint: Callable[[Path], None] | None = None
    # The classes the study's trials trained on (in output order): a train split with
    # others (one's own image folder changed) is a DatasetError, not a model of other shape.
    class_names: Sequence[str] | None = None


def best_model_path_for(checkpoint_path: Path) -> Path:
    """The best model's weights live next to the checkpoint: trial.pt -> trial.best.pt.
    Here, without torch: the search layer uploads and fetches the file too."""
    return checkpoint_path.with_name(checkpoint_path.stem + ".best.pt")
