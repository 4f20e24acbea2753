"""One trial: data, model, optimizer, loop, eval. Read it top to bottom.

`train()` is what the search layer calls. It returns a `TrialResult` for every ordinary
ending (finished, pruned, early stop, NaN loss, out of memory, time limit, interrupt) and
raises only hpsearch errors (DataError, ConfigError, DeviceError, CheckpointError).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import gc
import logging
import math
import multiprocessing.util  # noqa: F401 - its exit handler is registered before ours
import os
import pickle
import random
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from hpsearch.background import lower_priority
from hpsearch.config import Hyperparams, StudyConfig
from hpsearch.errors import DataError, DatasetError, DeviceError, DiskFullError, HpsearchWarning
from hpsearch.trainer import augment, data
from hpsearch.trainer.losses import make_loss
from hpsearch.trainer.models import build_model
from hpsearch.trainer.optim import (
    Schedule,
    make_optimizer,
    micro_batches,
    scaled_lr,
    warmup_steps,
)
from hpsearch.trainer.types import (
    NO_ROOM,
    NOT_SAVED,
    CheckpointError,
    EpochRecord,
    Report,
    StopReason,
    TrainOptions,
    TrialResult,
    WarmCache,
    best_model_path_for,
    is_resource_error,
    resource_error_cause,
)
from torch import Tensor, nn

log = logging.getLogger(__name__)

EVAL_BATCH = 256  # images per eval forward; fixed so that every evaluation sums identically
CHECKPOINT_VERSION = 1
NAN_CHECK_EVERY_CUDA = 16  # steps between host syncs for the NaN check on GPU (CPU: every step)


# --- device, precision, seeds ------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            mask = os.environ.get("CUDA_VISIBLE_DEVICES")
            shown = f" (CUDA_VISIBLE_DEVICES={mask!r})" if mask else ""
            raise DeviceError(f"device {name}: CUDA is not available on this machine{shown}")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(
                f"device {name}: only {torch.cuda.device_count()} CUDA device(s) visible"
            )
        return dev
    raise DeviceError(f"device {name!r}: expected auto, cpu, cuda or cuda:N")


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype, None for float32. auto: bf16 on GPUs that have it, fp16 on older ones,
    fp32 on CPU (CPU autocast is slower than fp32 for convs)."""
    if device.type != "cuda":
        if precision == "fp16":
            warnings.warn(
                "trainer.precision: fp16 needs CUDA; using fp32 on the CPU", HpsearchWarning,
                stacklevel=3,
            )  # fmt: skip
            return None
        return torch.bfloat16 if precision == "bf16" else None
    if precision == "auto":
        # Native bf16 only (Ampere and later): torch counts emulated bf16 as supported, which
        # runs without tensor cores on a T4 or V100, slower than fp16.
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _autocast(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def image_size(config: StudyConfig, hp: Hyperparams) -> int:
    return config.trial_sizes(hp)[0]


def eval_size(config: StudyConfig, hp: Hyperparams) -> int:
    """px at which val and test are evaluated: the trial's size times trainer.eval_scale."""
    return config.trial_sizes(hp)[1]


def cache_size(config: StudyConfig, hp: Hyperparams) -> int:
    """Stored px: dataset.cache_size, else 8/7 of the trial's image size (room to crop)."""
    return config.dataset.cache_size or round(image_size(config, hp) * 8 / 7)


# --- data on the device --------------------------------------------------------------------


@dataclass
class Split:
    """One split ready for the loop: on the device (fast path) or a DataLoader (streaming)."""

    n: int
    images: Tensor | None = None  # uint8 (N, 3, S, S) on the device, channels_last strides
    labels: Tensor | None = None  # int64 (N,) on the device
    eval_images: Tensor | None = None  # uint8 (N, 3, R, R): the eval resize, done once
    loader: torch.utils.data.DataLoader[Any] | None = None
    sampler: data.EpochSampler | None = None


def _decoded_to_device(dec: data.Decoded, device: torch.device) -> tuple[Tensor, Tensor]:
    # numpy NHWC -> NCHW view with channels_last strides: no copy of the pixel layout
    images = torch.from_numpy(dec.images).permute(0, 3, 1, 2).to(device)
    return images, torch.from_numpy(dec.labels).to(device)


def _data_key(
    config: StudyConfig, src: data.Source, size: int, device: torch.device
) -> tuple[Any, ...]:
    """A split's key in the warm cache (its eval images': this plus ("eval", res))."""
    return (src.dataset, src.ident, src.split, len(src), size, str(device),
            config.dataset.on_corrupt)  # fmt: skip


def load_split(
    config: StudyConfig,
    src: data.Source,
    size: int,
    res: int,
    device: torch.device,
    fast: bool,
    workdir: Path,
    warm: WarmCache | None,
    *,
    train: bool,
    batch_size: int,
    seed: int,
) -> Split:
    """A split on the fast path (whole uint8 array on the device) or streaming path."""
    on_corrupt = config.dataset.on_corrupt
    if fast:
        key = _data_key(config, src, size, device)
        if warm is not None and key in warm.data:
            images, labels = warm.data[key]
        else:
            images, labels = _decoded_to_device(
                data.load_or_build_cache(src, size, workdir, on_corrupt), device
            )
            if warm is not None:
                warm.put_data(key, (images, labels))
        split = Split(n=len(labels), images=images, labels=labels)
        if not train:
            ekey = (*key, "eval", res)
            if warm is not None and ekey in warm.data:
                split.eval_images = warm.data[ekey]
            else:
                split.eval_images = torch.cat(
                    [augment.eval_resize(c, res) for c in images.split(EVAL_BATCH)]
                )
                if warm is not None:
                    warm.put_data(ekey, split.eval_images)
        return split
    dataset = data.StreamDataset(src, size, on_corrupt)
    sampler = data.EpochSampler(len(src), seed, shuffle=train)
    # At most the cores this process may run on: more only take turns on them (and torch
    # warns, in several lines, once per loader).
    affinity = getattr(os, "sched_getaffinity", None)  # not on macOS
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    workers = min(config.trainer.num_workers, cores)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size if train else EVAL_BATCH,
        sampler=sampler,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        drop_last=train and len(src) >= batch_size,
        collate_fn=data.collate_skip,
        worker_init_fn=_loader_worker_init,
        # Its workers' base seed from a generator of its own: drawn from torch's global
        # one, it came out of the first epoch this process trains, whose dropout masks a
        # resumed run then drew differently from the uninterrupted run.
        generator=torch.Generator().manual_seed(seed),
    )
    if workers > 0:
        _LOADERS.add(loader)
    return Split(n=len(src), loader=loader, sampler=sampler)


# The streaming loaders whose worker processes may still live: they ignore SIGTERM
# (_loader_worker_init), which multiprocessing's exit handler sends them before it waits
# for them without a limit; a process that exits holding one (a trial's exception kept by
# its traceback) hung there. They are killed first (atexit runs handlers last in, first out:
# this one, registered after torch imported multiprocessing, runs before its).
_LOADERS: weakref.WeakSet[torch.utils.data.DataLoader[Any]] = weakref.WeakSet()


def _kill_loader_workers() -> None:
    for loader in list(_LOADERS):
        iterator = getattr(loader, "_iterator", None)  # persistent workers live there
        with contextlib.suppress(Exception):  # at exit: whatever is left goes anyway
            # The loader's own shutdown first (no "worker killed by signal" error), which
            # asks them to stop and waits 5 s at most
            getattr(iterator, "_shutdown_workers", lambda: None)()
        for proc in getattr(iterator, "_workers", None) or ():
            with contextlib.suppress(Exception):
                if proc.is_alive():
                    proc.kill()


atexit.register(_kill_loader_workers)  # after multiprocessing.util's (imported above)


def _loader_worker_init(_: int) -> None:
    """A stop is the trial's process's to make, at an epoch's end. A SIGTERM or SIGINT sent
    to every process of the job (systemd's control-group kill, Slurm's scancel, `kill` of a
    process group) killed the loader's workers first, and the trial failed with "DataLoader
    worker exited unexpectedly" instead of being handed back to resume. The loader ends
    its workers itself, and they exit when their parent dies."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _loader_items(loader: torch.utils.data.DataLoader[Any]) -> Iterator[Any]:
    """A DataLoader's batches. A DataError of one of its worker processes comes back with
    the worker's traceback in its message ("Caught DataError in DataLoader worker process
    0. Original Traceback ..."); it is raised here as its own one line again."""
    try:
        yield from loader
    except DataError as exc:
        lines = str(exc).strip().splitlines()
        if len(lines) < 2 or "DataLoader worker" not in lines[0]:
            raise
        raise type(exc)(lines[-1].split(": ", 1)[-1]) from None


def train_batches(
    split: Split, batch_size: int, seed: int, epoch: int, device: torch.device
) -> Iterator[tuple[Tensor, Tensor]]:
    """uint8 (B, 3, S, S) batches on the device in an order fixed by (seed, epoch). The last
    incomplete batch is dropped unless the split is smaller than one batch."""
    if split.loader is not None:
        assert split.sampler is not None
        split.sampler.set_epoch(epoch)
        for x, y in _loader_items(split.loader):
            if len(y):
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return
    assert split.images is not None and split.labels is not None
    g = torch.Generator().manual_seed(data.epoch_seed(seed, epoch, 1))
    perm = torch.randperm(split.n, generator=g).to(device)
    steps = max(1, split.n // batch_size)
    for i in range(steps):
        idx = perm[i * batch_size : (i + 1) * batch_size]
        yield split.images[idx], split.labels[idx]


def eval_batches(
    split: Split, res: int, device: torch.device, batch: int = EVAL_BATCH
) -> Iterator[tuple[Tensor, Tensor]]:
    """Normalized float (B, 3, R, R) eval batches of at most `batch` images, in file order."""
    if split.loader is not None:
        for x, y in _loader_items(split.loader):
            for xc, yc in zip(x.split(batch), y.split(batch), strict=True):
                if len(yc):
                    xd = xc.to(device, non_blocking=True)
                    yield augment.eval_batch(xd, res), yc.to(device, non_blocking=True)
        return
    assert split.eval_images is not None and split.labels is not None
    for x, y in zip(split.eval_images.split(batch), split.labels.split(batch), strict=True):
        yield augment.normalize(x), y


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    split: Split,
    res: int,
    num_classes: int,
    device: torch.device,
    amp: torch.dtype | None,
    channels_last: bool,
    batch: int = EVAL_BATCH,
    flip: bool = False,
) -> tuple[float, float, Tensor]:
    """(accuracy, mean cross-entropy, confusion (C, C) rows=true) over the split. `flip`:
    of the mean logits of each image and its horizontal mirror."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.long)
    confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.long)
    n = 0
    try:
        for x, y in eval_batches(split, res, device, batch):
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with _autocast(device, amp):
                logits = model(x).float()
                if flip:
                    logits = (logits + model(x.flip(3)).float()) / 2
            loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
            pred = logits.argmax(1)
            correct += (pred == y).sum()
            confusion += torch.bincount(y * num_classes + pred, minlength=num_classes**2)
            n += len(y)
    finally:  # an evaluation that failed (out of memory, retried) leaves it training
        model.train(was_training)
    if n == 0 and split.n > 0:  # streamed, each image skipped (on_corrupt: skip): no 0/0
        raise DatasetError(f"none of the {split.n} images of an eval split could be decoded")
    n = max(n, 1)
    return correct.item() / n, loss_sum.item() / n, confusion.view(num_classes, num_classes)


def evaluate_fitting(
    model: nn.Module,
    split: Split,
    res: int,
    num_classes: int,
    device: torch.device,
    amp: torch.dtype | None,
    channels_last: bool,
    batch: int,
    micro: int,
    flip: bool = False,
) -> tuple[tuple[float, float, Tensor], int]:
    """`evaluate` in batches of `batch` images, or, when those run out of memory, of the
    trial's training micro-batch: that fits (it trained), with gradients besides. A small
    training batch at a large image size fit where 256 images of inference did not, and the
    trial was told out of memory at its batch size, which the sampler then learned to avoid.
    Returns the result and the batch it took, for the next evaluation. (Smaller batches sum
    the loss in another order: equal to ~1e-15.)"""
    try:
        return (
            evaluate(model, split, res, num_classes, device, amp, channels_last, batch, flip),
            batch,
        )
    except RuntimeError as exc:
        if micro >= batch or not _out_of_memory(exc, device):
            raise
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log.warning("evaluation out of memory in batches of %d images: batches of %d", batch, micro)
    return (
        evaluate(model, split, res, num_classes, device, amp, channels_last, micro, flip),
        micro,
    )


# --- checkpoints -------------------------------------------------------------------------


class _Dropped(Exception):
    """A write given up half-way (`_CheckpointWriter.drop`): the old file stays."""


class _DroppableFile:
    """The file torch.save writes to, in pieces: a write after `drop` is set raises, and a
    write's OSError is kept (`error`): torch's writer hands it on as "unexpected pos"."""

    def __init__(self, fh: Any, drop: threading.Event | None) -> None:
        self._fh, self._drop = fh, drop
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        if self._drop is not None and self._drop.is_set():
            raise _Dropped
        try:
            return int(self._fh.write(data))
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._fh.flush()


def atomic_save(obj: Any, path: Path, drop: threading.Event | None = None) -> bool:
    """torch.save to a temp file in the same folder, fsync, os.replace: readers see the old
    file or the new one, never half of one. Any OSError -> CheckpointError, old file kept.
    With `drop`, the write is given up once it is set (False; the old file is kept)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    out: _DroppableFile | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            out = _DroppableFile(fh, drop)
            torch.save(obj, cast(IO[bytes], out))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return True
    except BaseException as exc:
        # A part-written temp file is never left: on a full disk it kept the disk full.
        with contextlib.suppress(OSError):
            tmp.unlink()
        if drop is not None and drop.is_set():
            return False  # torch.save may hand our _Dropped back wrapped (C++ writer)
        # torch.save reports a failed write (a full disk) as a RuntimeError from its C++
        # writer ("enforce fail at inline_container.cc ... unexpected pos"): the write's own
        # OSError, kept, says why (QA: judged by the free space after, another process's
        # writes made a full disk look like none).
        if isinstance(exc, RuntimeError) and out is not None and out.error is not None:
            exc = out.error
        if isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and _write_failed(exc)):
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            kept = "the previous one is intact" if path.exists() else "none was there before"
            if (no_room := _no_room(exc, path.parent, obj)) is not None:
                # DiskFullError: the worker hands its trial back and stops until there is room.
                raise DiskFullError(
                    f"checkpoint {path}: not written: {no_room}; {kept}", _tensor_bytes(obj)
                ) from exc
            raise CheckpointError(
                f"checkpoint {path}: write failed ({' '.join(reason.split())[:200]}); {kept}"
            ) from exc
        raise


# Not EFBIG: a file-size limit (FAT32's 4 GiB) is no room that freeing space would make.
_NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def _no_room(exc: BaseException, folder: Path, obj: Any) -> str | None:
    """Why a failed write failed for want of room (a full or read-only disk), in words, or
    None. torch's writer says only "unexpected pos": the free space is compared with the
    tensors' bytes (the QA's message named no disk, nor that it was full)."""
    need = _tensor_bytes(obj)
    try:
        st = os.statvfs(folder)
        free, read_only = st.f_bavail * st.f_frsize, bool(st.f_flag & os.ST_RDONLY)
    except OSError:
        free, read_only = None, False
    if isinstance(exc, OSError):
        if exc.errno == errno.EROFS:
            return NO_ROOM[2]
        if exc.errno not in _NO_ROOM_ERRNOS:
            return None
        what = NO_ROOM[1] if exc.errno == errno.EDQUOT else NO_ROOM[0]
    elif read_only:
        return NO_ROOM[2]
    elif free is not None and free < need + (1 << 20):
        what = NO_ROOM[0]
    else:
        return None
    shown = "?" if free is None else str(free >> 20)
    return f"{what} ({shown} MiB free, {need >> 20} MiB to write)"


def _tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in a (nested) state dict: about what torch.save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _write_failed(exc: RuntimeError) -> bool:
    """torch.save's C++ writer failing to write (its messages name the file writer)."""
    text = str(exc)
    return "inline_container" in text or "PytorchStreamWriter" in text or "file write" in text


def _cpu_copy(obj: Any) -> Any:
    """A deep copy whose tensors live on the CPU: what a checkpoint written while training
    goes on must hold (state_dict() only references the live, changing tensors)."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


class _CheckpointWriter:
    """Writes checkpoint files on a background thread while the next epoch trains: on a fast
    GPU an epoch can take less than writing ~100 MB. One job at a time, in order; a failed
    write raises CheckpointError at the next submit or at `wait` (the previous file is
    intact either way, atomic_save sees to that). `drop` gives up a resume checkpoint that
    is not on disk yet, for a trial that has ended for good."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._drop = threading.Event()
        self.failed_path: Path | None = None  # the file of the write that failed

    def submit(
        self,
        files: list[tuple[dict[str, Any], Path]],
        done: Callable[[], None] | None = None,
        droppable: Path | None = None,
    ) -> None:
        """Write `files` in order, then call `done` (when every write succeeded). The file
        at `droppable` (the resume checkpoint) is not written, nor `done` called, once
        `drop` was called."""
        self.wait()
        snapshot = [(_cpu_copy(obj), path) for obj, path in files]
        drop = self._drop

        def write() -> None:
            # Idle CPU time only: the training thread waits for it, when it must, at the next
            # save and at the trial's end, which frees a core for it (lower_priority).
            lower_priority(idle=True)
            path = None
            try:
                for obj, path in snapshot:
                    if path == droppable:
                        if drop.is_set() or not atomic_save(obj, path, drop):
                            return
                    else:
                        atomic_save(obj, path)
            except BaseException as exc:  # re-raised on the training thread
                self._error, self.failed_path = exc, path
                return
            if done is not None:
                try:
                    done()
                except Exception as exc:  # a hook (an upload hand-off) must not fail training
                    log.warning("after-checkpoint hook failed: %s", exc)

        self._thread = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def drop(self) -> None:
        """Give up the resume checkpoint still being written (its temp file is removed and
        the previous one kept); the best-model file is still written in full."""
        self._drop.set()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _rng_states(gen: torch.Generator | None, np_rng: np.random.Generator | None) -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "augment": gen.get_state() if gen is not None else None,
        "augment_numpy": np_rng.bit_generator.state if np_rng is not None else None,
    }


def _restore_rng(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"].cpu())  # map_location may have moved it
    if states.get("cuda") is not None and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # another GPU count than when saved
            torch.cuda.set_rng_state_all([s.cpu() for s in states["cuda"]])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])


# --- the trial ---------------------------------------------------------------------------


@dataclass
class _Run:
    """Everything train() reports, filled as the trial goes (also on out-of-memory)."""

    history: list[EpochRecord] = field(default_factory=list)
    best_acc: float | None = None
    best_loss: float | None = None
    best_epoch: int | None = None
    best_confusion: list[list[int]] | None = None
    best_state: dict[str, Tensor] | None = None  # CPU copy (the best-model file once saved)
    evals_since_best: int = 0
    stop_reason: StopReason = "finished"
    message: str = ""
    pruned_at: int | None = None
    test_acc: float | None = None
    effective_lr: float = 0.0
    batch_size: int = 0
    micro_batch: int = 0
    setup_seconds: float = 0.0
    train_seconds: float = 0.0
    elapsed_before: float = 0.0  # wall s of the trial's earlier tries (its resume checkpoint)
    num_classes: int = 0
    class_names: list[str] = field(default_factory=list)
    checkpoint_path: Path | None = None
    best_model_path: Path | None = None


# Stop reasons after which a trial is never resumed (it is pruned, or trained to its end).
ENDED_FOR_GOOD = frozenset({"pruned", "finished", "early_stopped"})


def train(
    config: StudyConfig,
    params: Mapping[str, Any],
    report: Report = lambda epoch, value: False,
    options: TrainOptions = TrainOptions(),
) -> TrialResult:
    """Train one trial of `config` with `params` (merged over trainer.defaults)."""
    start = time.perf_counter()
    hp = config.resolve_params(params)
    device = resolve_device(options.device)
    run = _Run()
    oom: str | None = None  # why, when out of memory or workspace
    writer = _CheckpointWriter()
    write_error: CheckpointError | None = None
    try:
        _train(config, hp, dict(params), report, options, device, run, start, writer)
    except RuntimeError as exc:  # torch's out-of-memory error is one too
        if not _out_of_memory(exc, device):
            raise
        # Handled below, outside the except block, so the traceback is gone.
        cause = None if isinstance(exc, torch.OutOfMemoryError) else resource_error_cause(exc)
        oom = f": {cause}" if cause else ""
    finally:
        try:
            writer.wait()  # the last checkpoint is on disk before the result is
        except CheckpointError as exc:  # one of the trial's last writes; _train's own error wins
            write_error = exc
    if write_error is not None:
        # One of the trial's last writes failed: the trained result stands. An interrupted
        # trial's older best-model file still goes with its older checkpoint (the retry
        # resumes from that pair); one of a trial that ended is an earlier epoch's, not the
        # best one, and is not kept.
        failed = writer.failed_path
        # A full disk's in words (torch's writer says only "unexpected pos"), others' cause.
        full = isinstance(write_error, DiskFullError)
        reason = str(write_error).split(": not written: ")[-1] if full else None
        reason = reason or write_error.__cause__ or write_error
        note = f"{NOT_SAVED}{failed.name if failed else 'a checkpoint'} ({reason})"
        if (
            failed is not None
            and failed == run.best_model_path
            and run.stop_reason != "interrupted"
        ):
            with contextlib.suppress(OSError):
                failed.unlink()
            run.best_model_path = None
            note += "; no best-model file is kept"
        run.message = "; ".join(m for m in (run.message, note) if m)
        log.warning("%s", note)
    if run.checkpoint_path is not None and not run.checkpoint_path.is_file():
        run.checkpoint_path = None  # its only save was given up
    if oom is not None:
        if options.warm is not None:
            # A step cut short left its gradients on a cached compiled model: about one
            # model of memory held until that model is reused.
            for cached, _ in options.warm.models.values():
                cached.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        run.stop_reason = "out_of_memory"
        run.message = (
            f"out of memory at batch_size={run.batch_size or hp.batch_size} "
            f"(micro-batch {run.micro_batch or hp.batch_size}, {hp.arch} at "
            f"{image_size(config, hp)} px){oom}"
        )
        run.test_acc = None
    final = next((r.val_acc for r in reversed(run.history) if r.val_acc is not None), None)
    return TrialResult(
        history=list(run.history),
        best_val_acc=run.best_acc,
        best_val_loss=run.best_loss,
        final_val_acc=final,
        test_acc=run.test_acc,
        stop_reason=run.stop_reason,
        epochs_run=len(run.history),
        pruned_at_epoch=run.pruned_at,
        checkpoint_path=run.checkpoint_path,
        best_model_path=run.best_model_path,
        effective_lr=run.effective_lr,
        effective_batch_size=run.batch_size,
        micro_batch_size=run.micro_batch,
        train_seconds=run.train_seconds,
        setup_seconds=run.setup_seconds,
        confusion=run.best_confusion,
        message=run.message,
        num_classes=run.num_classes,
        class_names=list(run.class_names),
    )


def _finite_weights(model: nn.Module) -> bool:
    """Whether every parameter and buffer is finite (one host sync)."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True


def _out_of_memory(exc: RuntimeError, device: torch.device) -> bool:
    """torch's out-of-memory error, or cuDNN's and cuBLAS's allocation failures (plain
    RuntimeErrors). A sticky CUDA error (a device-side assert, an illegal access) can surface
    as a library's failure: the device then fails its next sync, and it is no lack of memory."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return is_resource_error(exc) and _device_usable(device)


def _device_usable(device: torch.device) -> bool:
    """False when the CUDA device is in a sticky error state (its context is lost)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
    except RuntimeError:
        return False
    return True


def _train(
    config: StudyConfig,
    hp: Hyperparams,
    params: dict[str, Any],
    report: Report,
    options: TrainOptions,
    device: torch.device,
    run: _Run,
    start: float,
    writer: _CheckpointWriter,
) -> None:
    tc = config.trainer
    seed = tc.seed if options.seed is None else options.seed
    seed_everything(seed)
    if device.type == "cuda":
        if device.index is not None:
            torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls/convs for fp32 parts
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = tc.cudnn_benchmark
    amp = resolve_precision(tc.precision, device)
    res, size = image_size(config, hp), cache_size(config, hp)
    eval_res = eval_size(config, hp)  # px of val and test; res trains
    workdir = Path(options.workdir)

    # --- data ---------------------------------------------------------------------------
    splits = ["train", "val"] + (["test"] if tc.evaluate_test else [])
    sources = {s: data.get_source(config, s) for s in splits}
    train_src, val_src = sources["train"], sources["val"]
    assert train_src is not None and val_src is not None
    if options.class_names is not None:  # the study's (its first worker recorded them)
        changed = data.class_change(options.class_names, train_src.class_names)
        if changed is not None:
            raise DatasetError(f"dataset {config.dataset.name}: {changed}")
    run.class_names = list(train_src.class_names)
    run.num_classes = num_classes = len(train_src.class_names)
    fast = data.use_fast_path(config, [s for s in sources.values() if s is not None], size)
    batch_size = hp.batch_size
    micro, accum = micro_batches(batch_size, tc.max_micro_batch)
    run.batch_size, run.micro_batch = batch_size, micro

    told_loss = "val_loss" in config.objective.metrics  # an objective: Optuna takes no inf
    in_use: set[tuple[Any, ...]] = set()  # warm-cache keys of the splits loaded so far
    own_model: tuple[Any, ...] | None = None  # this trial's compiled model's key, once built

    def split_of(src: data.Source, is_train: bool) -> Split:
        nonlocal fast

        def load(on_device: bool) -> Split:
            split = load_split(config, src, size, eval_res, device, on_device, workdir,
                               options.warm, train=is_train, batch_size=batch_size,
                               seed=seed)  # fmt: skip
            if on_device:
                key = _data_key(config, src, size, device)
                in_use.update([key] if is_train else [key, (*key, "eval", eval_res)])
            return split

        if not (fast and config.dataset.fast_path == "auto"):
            return load(fast)
        # The GPU may have less room than max_cache_mb allows. Not the trial's batch size:
        # were it reported as out of memory, the sampler would learn that its values fail.
        # The worker's cached datasets (other image sizes', often) are given up first, then
        # this and later splits stream from the CPU.
        for last_try in (False, True):
            try:
                return load(True)
            except RuntimeError as exc:
                if not _out_of_memory(exc, device):
                    raise
            # Retried only when the cache held more than this trial's splits loaded so far
            # (in use whatever the cache holds): other splits, sizes, compiled models.
            warm = options.warm
            mine = _data_key(config, src, size, device)  # this split's own, partly made
            own = {*in_use, mine, (*mine, "eval", eval_res)}
            held = warm is not None and (
                any(k not in own for k in warm.data) or any(k != own_model for k in warm.models)
            )
            if warm is not None:
                warm.data.clear()
                for k in [k for k in warm.models if k != own_model]:
                    del warm.models[k]
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if last_try or not held:
                break
        fast = False
        warnings.warn(
            f"dataset {config.dataset.name}: its {src.split} split does not fit in GPU memory "
            "beside training (dataset.fast_path: auto): streamed from the CPU",
            stacklevel=2,
        )
        return load(False)

    train_split = split_of(train_src, True)
    if 0 < train_split.n < batch_size:
        # One batch of the whole split an epoch: that is the batch the lr is scaled for and
        # the trial reports (batch_size 2048 on Flowers-102's 1020 images trains on 1020).
        batch_size = train_split.n
        micro, accum = micro_batches(batch_size, tc.max_micro_batch)
        run.batch_size, run.micro_batch = batch_size, micro
    val_split = split_of(val_src, False)
    steps_per_epoch = max(1, train_split.n // batch_size)

    # --- model ----------------------------------------------------------------------------
    model = build_model(config, hp, num_classes)
    memory_format = torch.channels_last if tc.channels_last else torch.contiguous_format
    fwd: nn.Module
    if tc.compile and options.warm is not None:
        key = (hp.arch, res, batch_size, num_classes, str(device), tc.channels_last, amp)
        own_model = key
        if (entry := options.warm.get_model(key)) is not None:
            cached, fwd = entry  # same graph: reuse the compiled code, reset the weights
            cached.load_state_dict(model.state_dict())
            # A trial that failed mid-step (out of memory between micro-batches) left its
            # gradients on the parameters: the next backward() would add to them.
            cached.zero_grad(set_to_none=True)
            model = cached
        else:
            model = model.to(device, memory_format=memory_format)
            fwd = torch.compile(model)  # type: ignore[assignment]
            options.warm.put_model(key, (model, fwd))
    else:
        model = model.to(device, memory_format=memory_format)
        fwd = torch.compile(model) if tc.compile else model  # type: ignore[assignment]
    model.train()

    # --- optimizer, schedule, loss --------------------------------------------------------
    run.effective_lr = lr = scaled_lr(hp.lr, batch_size, tc.base_batch_size, hp.lr_scaling)
    optimizer = make_optimizer(model, hp, lr)
    schedule = Schedule(
        hp.schedule,
        lr,
        total_steps=steps_per_epoch * config.budget.max_epochs,
        warmup_steps=warmup_steps(hp.warmup_epochs, steps_per_epoch),
    )
    scaler = torch.amp.GradScaler(device.type) if amp == torch.float16 else None
    loss_fn = make_loss(hp)
    spec = augment.AugmentSpec(
        hp.augment, hp.augment_strength, res, num_classes, hp.mixup_alpha, hp.cutmix_alpha
    )

    # --- resume ---------------------------------------------------------------------------
    ckpt_path = options.checkpoint_path
    best_path = best_model_path_for(ckpt_path) if ckpt_path is not None else None
    first_epoch = 1
    if ckpt_path is not None and ckpt_path.is_file():
        try:
            ckpt = _resume(ckpt_path, hp, model, optimizer, schedule, scaler, run)
        except CheckpointError:
            raise
        except Exception as exc:  # a damaged file, or one of another layout: torch, pickle
            if isinstance(exc, RuntimeError) and _out_of_memory(exc, device):
                raise  # copying it onto the GPU: train's out-of-memory handling
            raise CheckpointError(
                f"checkpoint {ckpt_path}: cannot resume from it ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:300]}); delete it to start the trial afresh"
            ) from exc
        first_epoch = ckpt["epoch"] + 1
        if best_path is not None and best_path.is_file():
            saved = _saved_epoch(best_path)
            if saved is None or saved == run.best_epoch:  # unread: kept, as before
                run.best_model_path = best_path
            else:
                # Written just before a crash that took the checkpoint of its epoch: that
                # epoch is trained again here and may not be the best this time, so these
                # are not the best weights the run reports (its test pass, load_best_model).
                log.warning("%s: an epoch after its checkpoint's; not kept", best_path)
                with contextlib.suppress(OSError):
                    best_path.unlink()
        run.checkpoint_path = ckpt_path
        if ckpt.get("stop_reason") not in (None, "finished", "interrupted", "time_limit"):
            first_epoch = config.budget.max_epochs + 1  # it had stopped for good
            run.stop_reason = ckpt["stop_reason"]
        if _report_restored(config, run, report):
            first_epoch = config.budget.max_epochs + 1
    run.setup_seconds = time.perf_counter() - start

    # --- the loop -------------------------------------------------------------------------
    timeout = config.budget.trial_timeout_s

    def elapsed() -> float:  # wall s of the trial: a retry's limit counts its earlier tries
        return run.elapsed_before + time.perf_counter() - start

    check_every = NAN_CHECK_EVERY_CUDA if device.type == "cuda" else 1
    eval_batch = EVAL_BATCH  # images per eval forward; the micro-batch once that ran out
    step = (first_epoch - 1) * steps_per_epoch
    gen: torch.Generator | None = None
    np_rng: np.random.Generator | None = None
    last_saved = time.perf_counter()  # of the resume checkpoint
    saved_through = first_epoch - 1  # the epoch the resume checkpoint on disk ends with
    best_unsaved = False  # a better model than the best-model file holds

    def best_files() -> list[tuple[dict[str, Any], Path]]:
        nonlocal best_unsaved
        if not (best_unsaved and best_path is not None and run.best_state is not None):
            return []
        best_unsaved = False
        run.best_model_path = best_path
        epoch_, acc = int(run.best_epoch or 0), float(run.best_acc or 0.0)
        return [(_best_file(run.best_state, hp, run, epoch_, acc), best_path)]

    def checkpoint_written() -> None:  # on the writer thread
        if options.on_checkpoint is not None and ckpt_path is not None:
            options.on_checkpoint(ckpt_path)

    def save_best() -> None:  # a trial stopped by its time limit keeps its best model
        if files := best_files():
            submit_last(files)

    def submit_last(files: list[tuple[dict[str, Any], Path]], *args: Any, **kwargs: Any) -> None:
        """The trial's last writes: an earlier resume checkpoint's failed write (a full disk)
        does not fail a trial that ends here (nothing resumes it; review): they are tried."""
        try:
            writer.submit(files, *args, **kwargs)
        except CheckpointError:
            writer.submit(files, *args, **kwargs)

    for epoch in range(first_epoch, config.budget.max_epochs + 1):
        if options.should_interrupt is not None and options.should_interrupt():
            if ckpt_path is not None and epoch - 1 > saved_through:  # keep what was trained
                state = _checkpoint(model, optimizer, schedule, scaler, epoch - 1, gen, np_rng,
                                    hp, run, None, elapsed(),
                                    with_best_state=best_path is None)  # fmt: skip
                writer.submit([*best_files(), (state, ckpt_path)], checkpoint_written)
                run.checkpoint_path = ckpt_path
            run.stop_reason, run.message = "interrupted", f"interrupted before epoch {epoch}"
            return
        if timeout is not None and elapsed() > timeout:  # the epoch before ended past it
            run.stop_reason = "time_limit"
            run.message = (
                f"trial time limit {timeout:g}s reached before epoch {epoch}; "
                f"{len(run.history)} complete epochs kept"
            )
            save_best()
            break  # to the test pass
        t_epoch = time.perf_counter()
        # Every random stream is re-seeded from (seed, epoch): a resumed run draws exactly
        # what the uninterrupted one would have drawn.
        torch.manual_seed(data.epoch_seed(seed, epoch, 0))  # dropout, stochastic depth
        gen = torch.Generator(device=device).manual_seed(data.epoch_seed(seed, epoch, 2))
        np_rng = np.random.default_rng(data.epoch_seed(seed, epoch, 3))

        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        correct = torch.zeros((), device=device, dtype=torch.long)
        first_bad = torch.full((), -1, device=device, dtype=torch.long)
        seen = 0
        cut_short = False  # the time limit stopped the epoch before its last step
        for i, (x_u8, y) in enumerate(train_batches(train_split, batch_size, seed, epoch, device)):
            schedule.apply(optimizer, step)
            n = x_u8.shape[0]
            # At least 2 images a chunk: BatchNorm refuses 1 (a split smaller than one batch
            # is a single short batch, which `accum` chunks would cut to 1 or 0 images).
            chunks = min(accum, max(1, n // 2))
            # Warped and coloured a chunk at a time: the policies' float copies (about 12
            # batches' worth for trivial/randaugment) scale with the micro-batch, not with
            # the batch that micro-batching is there to fit.
            x, target = augment.train_batch(x_u8, y, spec, gen, np_rng, chunks=chunks)
            for xc, tc_ in zip(x.tensor_split(chunks), target.tensor_split(chunks), strict=True):
                xc = xc.contiguous(memory_format=memory_format)
                with _autocast(device, amp):
                    logits = fwd(xc)
                loss = loss_fn(logits, tc_)
                weighted = loss * (xc.shape[0] / n)  # chunk share: sum == full-batch mean
                (scaler.scale(weighted) if scaler is not None else weighted).backward()
                loss_sum += loss.detach().double() * xc.shape[0]
                label = tc_ if tc_.dim() == 1 else tc_.argmax(1)
                correct += (logits.detach().argmax(1) == label).sum()
                first_bad = torch.where(
                    (first_bad < 0) & ~torch.isfinite(loss.detach()),
                    torch.full_like(first_bad, i + 1),
                    first_bad,
                )
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            seen += n
            if (i + 1) % check_every == 0 and first_bad.item() >= 0:
                break
            if timeout is not None and elapsed() > timeout:
                cut_short = i + 1 < steps_per_epoch  # else the epoch is whole: evaluated
                break
        if seen == 0 and train_split.n > 0 and not cut_short:
            # Streamed, each image skipped (on_corrupt: skip): an epoch of no steps.
            raise DatasetError(
                f"none of the {train_split.n} images of the train split could be decoded"
            )
        bad_step = int(first_bad.item())
        if bad_step >= 0:
            bad = loss_sum.item()
            kind = "nan" if math.isnan(bad) else "inf"
            run.stop_reason = "diverged"
            run.message = f"loss is {kind} at epoch {epoch} step {bad_step}"
            # No best model written: told PRUNED, it is never ranked (see `discard` below).
            return
        if cut_short:
            run.stop_reason = "time_limit"
            run.message = (
                f"trial time limit {timeout:g}s reached during epoch {epoch}; "
                f"{len(run.history)} complete epochs kept"
            )
            save_best()
            break  # to the test pass
        train_time = time.perf_counter() - t_epoch

        # --- eval ---------------------------------------------------------------------------
        val_acc = val_loss = None
        confusion = None
        if epoch % tc.eval_every == 0 or epoch == config.budget.max_epochs:
            (val_acc, val_loss, confusion), eval_batch = evaluate_fitting(
                fwd, val_split, eval_res, num_classes, device, amp, tc.channels_last,
                eval_batch, micro, tc.eval_flip,
            )  # fmt: skip
            if not math.isfinite(val_loss):
                if not _finite_weights(model):  # the epoch's last step broke them
                    run.stop_reason = "diverged"
                    run.message = f"validation loss is {val_loss} after epoch {epoch}"
                    return  # as a diverged step: not reported, no best model (PRUNED)
                # Sound weights, logits past fp16's range on some image: a loss, not a
                # divergence. The epoch counts; it is never the best where the loss is
                # told to Optuna (_improves).
                val_loss = math.inf
            schedule.observe(val_loss)
        record = EpochRecord(
            epoch=epoch,
            train_loss=loss_sum.item() / max(seen, 1),
            train_acc=correct.item() / max(seen, 1),
            val_loss=val_loss,
            val_acc=val_acc,
            lr=schedule.last_lr,
            epoch_seconds=time.perf_counter() - t_epoch,
            images_per_second=seen / max(train_time, 1e-9),
        )
        run.history.append(record)
        run.train_seconds += record.epoch_seconds

        if val_acc is not None:
            assert confusion is not None and val_loss is not None
            if _improves(config.reported_metric, run, val_acc, val_loss, told_loss):
                run.best_acc, run.best_loss, run.best_epoch = val_acc, val_loss, epoch
                run.best_confusion = confusion.cpu().tolist()
                run.evals_since_best = 0
                # Kept in memory; written beside the checkpoint when that is next due.
                run.best_state = {
                    k: v.detach().cpu().clone() for k, v in model.state_dict().items()
                }
                best_unsaved = best_path is not None
            else:
                run.evals_since_best += 1
            value = reported_value(config, record)
            if report(epoch, value):
                run.stop_reason, run.pruned_at = "pruned", epoch
                run.message = f"pruned at epoch {epoch} ({config.reported_metric} {value:.4f})"
            elif tc.patience is not None and run.evals_since_best >= tc.patience:
                run.stop_reason = "early_stopped"
                run.message = (
                    f"early stopped at epoch {epoch}: no better {config.reported_metric} in "
                    f"{tc.patience} evals (best {_best_of(config.reported_metric, run):.4f} "
                    f"at epoch {run.best_epoch})"
                )
        # Checkpoint at most every trainer.checkpoint_every_s (0: every epoch), and always
        # at the trial's end or when a stop was asked for: writing ~100 MB per epoch would
        # dominate the sub-second epochs of small images on a fast GPU.
        # A trial that ends here is told next and its resume checkpoint deleted unread: it
        # only gets its best model written (a crash before the tell redoes the last epochs).
        ending = run.stop_reason != "finished" or epoch == config.budget.max_epochs
        stopping = options.should_interrupt is not None and options.should_interrupt()
        due = stopping or time.perf_counter() - last_saved >= tc.checkpoint_every_s
        # A pruned trial is never among the study's best, which Optuna ranks from complete
        # trials only, and the worker deletes its files once it is told: its best model is
        # not written (about 45 MB and an fsync for a ResNet-18, waited for before the tell).
        discard = run.stop_reason == "pruned"
        if ending and run.stop_reason in ENDED_FOR_GOOD:
            # Told next, and its resume checkpoint deleted unread: one still being written
            # (the epoch before; it gets idle CPU time only) is given up, not waited for.
            writer.drop()
        if ckpt_path is not None and (due or ending) and not discard:
            files = best_files()  # the best model first: the checkpoint refers to it
            done = None
            if not ending:
                state = _checkpoint(model, optimizer, schedule, scaler, epoch, gen, np_rng, hp,
                                    run, None, elapsed(),
                                    with_best_state=best_path is None)  # fmt: skip
                files.append((state, ckpt_path))
                done = checkpoint_written
                run.checkpoint_path = ckpt_path
                last_saved, saved_through = time.perf_counter(), epoch
            if files:
                (submit_last if ending else writer.submit)(files, done, droppable=ckpt_path)
        if options.on_epoch is not None:
            options.on_epoch(record)
        if run.stop_reason != "finished":
            break

    if (
        told_loss
        and run.best_acc is None
        and any(r.val_loss is not None for r in run.history)
        and run.stop_reason in ("finished", "early_stopped", "time_limit")
    ):  # every evaluated loss was infinite: nothing Optuna can be told
        run.stop_reason = "diverged"
        run.message = "no evaluated epoch had a finite validation loss"
        return

    # --- test: the best model of a complete trial (finished, early-stopped or timed out) -----
    # A trial stopped by its time limit is told COMPLETE with its best val_acc, and may be the
    # study's best: the limit bounds training, and its best weights get their test figure too.
    if run.stop_reason not in ("finished", "early_stopped", "time_limit"):
        return
    if not run.message:
        run.message = f"finished {len(run.history)} epochs"
    test_src = sources.get("test")
    if tc.evaluate_test and test_src is not None and run.best_acc is not None:
        if run.best_state is not None:
            model.load_state_dict(run.best_state)
        elif best_path is not None and best_path.is_file():
            model.load_state_dict(torch.load(best_path, map_location=device)["model"])
        else:  # resumed without its best model (lost with its host): not the best weights
            log.warning("test accuracy not measured: the best model's weights are gone")
            return
        try:
            test_split = split_of(test_src, False)
            (run.test_acc, _, _), _ = evaluate_fitting(
                fwd, test_split, eval_res, num_classes, device, amp, tc.channels_last,
                eval_batch, micro, tc.eval_flip,
            )  # fmt: skip
        except RuntimeError as exc:
            # The trained trial stands: only its test figure is missing (the test split is
            # loaded onto the device after training, 6149 images for Flowers-102).
            if not _out_of_memory(exc, device):
                raise
            run.test_acc = None
            run.message += "; test accuracy not measured: out of memory"
            log.warning("test accuracy not measured: out of memory")
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _improves(
    metric: str, run: _Run, val_acc: float, val_loss: float, told_loss: bool = False
) -> bool:
    """Whether an evaluated epoch beats the run's best by the metric the study optimizes
    (`StudyConfig.reported_metric`): the objective, the best model and its test accuracy
    all come from the best epoch, so a study minimizing val_loss takes the lowest loss.
    With `told_loss` (the loss is an objective) an infinite loss is never the best: Optuna
    takes no infinite value."""
    if told_loss and not math.isfinite(val_loss):
        return False
    if run.best_acc is None:
        return True
    if metric == "val_loss":
        best = run.best_loss
        return best is None or math.isnan(best) or val_loss < best
    return val_acc > run.best_acc


def _best_of(metric: str, run: _Run) -> float:
    value = run.best_loss if metric == "val_loss" else run.best_acc
    return float("nan") if value is None else float(value)


def reported_value(config: StudyConfig, record: EpochRecord) -> float:
    """What an evaluated epoch reports to the pruner (`StudyConfig.reported_metric`)."""
    if config.reported_metric == "val_loss":
        return float(record.val_loss if record.val_loss is not None else math.inf)
    return float(record.val_acc or 0.0)


SCHEDULE_SHAPE = ("kind", "peak_lr", "total_steps", "warmup_steps")


def _restore_schedule(schedule: Schedule, saved: Mapping[str, Any], path: Path) -> None:
    """A checkpoint's schedule state (the plateau's), the schedule's shape staying the current
    run's: a relaunch with a larger `budget.max_epochs` kept the old total steps, and the
    epochs past it trained at lr 0."""
    changed = [k for k in SCHEDULE_SHAPE if k in saved and saved[k] != getattr(schedule, k)]
    schedule.load_state_dict({k: v for k, v in saved.items() if k not in SCHEDULE_SHAPE})
    if changed:
        log.warning(
            "checkpoint %s: the lr schedule's %s changed since it was written (the study's "
            "budget or trainer settings); it goes on with the current ones",
            path,
            ", ".join(changed),
        )


def _resume(
    path: Path,
    hp: Hyperparams,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule,
    scaler: torch.amp.GradScaler | None,
    run: _Run,
) -> dict[str, Any]:
    """Restore a trial's state from its resume checkpoint; the checkpoint's dict, for its
    epoch and stop reason."""
    # Our own file (it holds numpy RNG state, so not weights_only), read onto the CPU:
    # load_state_dict copies onto the model's device, and a copy of the weights and the
    # optimizer's moments left on the GPU would be held beside training.
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if ckpt.get("params") != hp.model_dump():
        raise CheckpointError(
            f"checkpoint {path}: written for other hyperparameters; delete it or use another path"
        )
    model.load_state_dict(ckpt.pop("model"))
    try:
        optimizer.load_state_dict(ckpt.pop("optimizer"))
    except ValueError as exc:  # parameter groups of an older version (layer_scale's)
        warnings.warn(
            f"checkpoint {path}: its optimizer state does not fit this version's parameter "
            f"groups ({exc}); resumed with a fresh one",
            stacklevel=2,
        )
    _restore_schedule(schedule, ckpt["schedule"], path)
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    _restore_rng(ckpt["rng"])
    run.history = [EpochRecord(**r) for r in ckpt["history"]]
    for k, v in ckpt["run"].items():
        if k != "effective_lr":  # the current run's (its schedule is: _restore_schedule)
            setattr(run, k, v)
    run.train_seconds = ckpt["train_seconds"]
    run.elapsed_before = float(ckpt.get("elapsed_s", run.train_seconds))
    return ckpt


def _saved_epoch(best_path: Path) -> int | None:
    """The epoch a best-model file holds (memory-mapped: its weights are not read); None
    when it cannot be read."""
    try:
        saved = torch.load(best_path, map_location="cpu", weights_only=False, mmap=True)
        return int(saved["epoch"])
    except Exception:  # any reading error: the caller keeps the file, as it did before
        return None


def _best_file(
    state: dict[str, Tensor], hp: Hyperparams, run: _Run, epoch: int, val_acc: float
) -> dict[str, Any]:
    return {
        "model": state,
        "arch": hp.arch,
        "params": hp.model_dump(),
        "num_classes": run.num_classes,
        "class_names": run.class_names,
        "epoch": epoch,
        "val_acc": val_acc,
        "torchvision": torchvision.__version__,
    }


def _report_restored(config: StudyConfig, run: _Run, report: Report) -> bool:
    """Report a resumed run's last restored evaluated epoch again, before it trains.

    A try killed between an epoch's checkpoint and its report's write (made off the training
    thread, one at a time, each after the one before it) left that one value out of the
    study, and the pruner never judged it; the retry resumes after it. A value the study
    already holds is not written again (Optuna ignores a repeated step). The one report asks
    the pruner once, as the try would have: Optuna's pruners judge the trial's latest stored
    step (this epoch, or a later one where reports went past the last checkpoint), and
    Hyperband answers each step's first ask only, so asking once per restored epoch would
    lose a stop. A run still going that the pruner stops ends as pruned here (True)."""
    last = next((r for r in reversed(run.history) if r.val_acc is not None), None)
    if last is None or not report(last.epoch, reported_value(config, last)):
        return False
    if run.stop_reason != "finished":
        return False  # it had stopped for good: its reason stands
    run.stop_reason, run.pruned_at = "pruned", last.epoch
    run.message = f"pruned on resuming, after epoch {last.epoch} (val_acc {last.val_acc:.4f})"
    return True


def _checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule,
    scaler: torch.amp.GradScaler | None,
    epoch: int,
    gen: torch.Generator | None,
    np_rng: np.random.Generator | None,
    hp: Hyperparams,
    run: _Run,
    stop_reason: str | None,
    elapsed_s: float,
    with_best_state: bool = True,
) -> dict[str, Any]:
    keep = (
        "best_acc",
        "best_loss",
        "best_epoch",
        "best_confusion",
        *(("best_state",) if with_best_state else ()),  # else it is in the best-model file
        "evals_since_best",
        "message",
        "pruned_at",
        "effective_lr",
    )
    return {
        "version": CHECKPOINT_VERSION,
        "epoch": epoch,
        "params": hp.model_dump(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": _rng_states(gen, np_rng),
        "history": [dataclasses.asdict(r) for r in run.history],
        "run": {k: getattr(run, k) for k in keep},
        "train_seconds": run.train_seconds,
        "elapsed_s": elapsed_s,  # wall s of the trial's tries up to this one's checkpoint
        "stop_reason": stop_reason,
    }


# --- using a trained model ---------------------------------------------------------------


class EvalTransform:
    """What a trial's validation images went through, for one PIL image of one's own: RGB
    (upright by its EXIF), the shorter side resized to the stored px and a center square
    crop, resized to the trial's eval px, ImageNet's mean and std: float32 (3, px, px).
    (With trainer.eval_flip the trial's accuracy averaged the logits of each image and its
    mirror, `x.flip(-1)`.)"""

    def __init__(self, stored_px: int, eval_px: int) -> None:
        self.stored_px, self.eval_px = stored_px, eval_px

    def __call__(self, image: Any) -> Tensor:
        from PIL import ImageOps

        if getattr(image, "format", None) == "JPEG":  # decoded as the trial's were
            with contextlib.suppress(Exception):  # a loaded image takes no draft: as it is
                image.draft("RGB", (self.stored_px, self.stored_px))
        upright = ImageOps.exif_transpose(image) or image
        x = torch.from_numpy(data.decode_image(upright, self.stored_px)).permute(2, 0, 1)
        return augment.eval_batch(x.unsqueeze(0), self.eval_px)[0]

    def __repr__(self) -> str:
        return f"EvalTransform(stored_px={self.stored_px}, eval_px={self.eval_px})"


def load_trained_model(
    config: StudyConfig,
    params: Mapping[str, Any],
    best_model_path: Path | str,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """The best model of a trial, in eval mode on `device` (for export or evaluation). Its
    architecture is the one the file records: a relaunch may have changed the study's
    defaults since the trial trained. Loaded with `weights_only=True`: the file may come
    from a shared MLflow server, and unpickling runs whatever code it names. For one's own
    images it carries `class_names` (the output index's name) and `transform`
    (`EvalTransform`: a PIL image to the input tensor the trial evaluated)."""
    from hpsearch.errors import CheckpointError, DataError

    hp = config.resolve_params(params)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    path = Path(best_model_path)
    if not path.is_file():
        raise DataError(f"best model {path}: file not found")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        num_classes = int(blob["num_classes"])
        arch = str(blob.get("arch") or hp.arch)
        model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
        model.load_state_dict(blob["model"])
        names = blob.get("class_names") or [str(i) for i in range(num_classes)]
        model.class_names = [str(n) for n in names]
        model.transform = EvalTransform(cache_size(config, hp), eval_size(config, hp))
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        # Damaged, truncated, not a model file of hpsearch's, or naming code to run.
        first = " ".join(str(exc).split())[:200]
        raise CheckpointError(
            f"best model {path}: not a readable hpsearch model file: {type(exc).__name__}: {first}"
        ) from exc
    return model.to(dev).eval()


def evaluate_model(
    config: StudyConfig,
    params: Mapping[str, Any],
    model: nn.Module,
    split: str = "val",
    workdir: Path = Path(".hpsearch"),
    device: str = "cpu",
) -> tuple[float, float]:
    """(accuracy, cross-entropy) of `model` on a split, with the eval transform and batching
    training used: the best model gives back the logged best_val_acc."""
    hp = config.resolve_params(params)
    dev = resolve_device(device)
    src = data.get_source(config, split)
    if src is None:
        from hpsearch.errors import DataError

        raise DataError(f"dataset {config.dataset.name}: has no {split} split")
    res, size = eval_size(config, hp), cache_size(config, hp)
    fast = data.use_fast_path(config, [src], size)
    s = load_split(
        config,
        src,
        size,
        res,
        dev,
        fast,
        Path(workdir),
        None,
        train=False,
        batch_size=EVAL_BATCH,
        seed=0,
    )
    fmt = torch.channels_last if config.trainer.channels_last else torch.contiguous_format
    model = model.to(dev).to(memory_format=fmt)  # the layout training evaluated with
    acc, loss, _ = evaluate(
        model,
        s,
        res,
        len(src.class_names),
        dev,
        resolve_precision(config.trainer.precision, dev),
        config.trainer.channels_last,
        flip=config.trainer.eval_flip,
    )
    return acc, loss
