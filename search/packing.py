"""Several workers on one GPU: how many fit, and whether a trial may start now.

Small-batch trials leave a GPU mostly idle (kernel launches, not arithmetic, bound each
step), so packing several worker processes on one GPU multiplies trials per hour. Two
limits decide how many: memory (the study's largest trial shape must fit beside the
others) and compute (more workers than it takes to keep the GPU busy only time-slice it).

The decisions are pure functions over numbers the probe (`hpsearch.probe`) measures.
`GpuLedger` is the admission control: each packed trial reserves its predicted peak
memory on its GPU before it starts, so packed trials never oversubscribe memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpsearch.errors import DeviceError

logger = logging.getLogger(__name__)

MiB = 1 << 20
TARGET_BUSY = 0.95  # fraction of the GPU's time packed workers together aim to keep busy
HEADROOM = 0.90  # fraction of a GPU's memory reservations may take (fragmentation, other users)
REFERENCE_FACTOR = 4  # the probe's reference batch: this many times the study's largest


class AdmissionStopped(Exception):
    """The worker was asked to stop while its trial waited for GPU memory, or it waited out
    its limit: the trial is re-queued untouched, not failed."""


@dataclass(frozen=True)
class MemoryModel:
    """Peak CUDA memory of one trial of `arch`: a fixed part (weights, gradients, optimizer
    state, workspaces) plus activations linear in batch size and in pixels per image,
    fitted from two probe batches at `image_size`. Bytes."""

    arch: str
    image_size: int  # px, the probe's
    fixed_bytes: int
    per_sample_bytes: int
    context_bytes: int  # the CUDA context and allocator slack of one process

    def trial_bytes(self, batch_size: int, image_size: int) -> int:
        scale = (image_size / self.image_size) ** 2
        return int(self.fixed_bytes + self.per_sample_bytes * batch_size * scale)


def fit_memory(
    arch: str,
    image_size: int,
    small: tuple[int, int],
    large: tuple[int, int],
    context_bytes: int,
) -> MemoryModel:
    """A line through two (batch size, peak bytes) probe points of the same arch and size."""
    (b1, m1), (b2, m2) = small, large
    if b2 <= b1:
        raise ValueError(f"probe batches must grow: got {b1} then {b2}")
    slope = max(0.0, (m2 - m1) / (b2 - b1))
    fixed = max(0.0, m2 - slope * b2)
    return MemoryModel(arch, image_size, int(fixed), math.ceil(slope), int(context_bytes))


def busy_fraction(
    step_s_small: float, batch_small: int, step_s_large: float, batch_large: int
) -> float:
    """How much of the GPU's time one worker keeps it busy at the small batch, taking the
    large batch as saturating: the time its images would take at the large batch's rate,
    over the time they take."""
    if step_s_small <= 0 or step_s_large <= 0:
        return 1.0
    ideal = step_s_large * batch_small / batch_large
    return max(0.01, min(1.0, ideal / step_s_small))


def reference_batch(
    largest: int,
    model: MemoryModel,
    total_bytes: int,
    factor: int = REFERENCE_FACTOR,
    share: float = 0.5,
) -> int:
    """The batch the probe times as filling the GPU: `factor` times the study's largest,
    halved while the memory model says it needs over `share` of the card; never below
    `largest`. A study's own largest batch is no such reference: on an H200, ResNet-18 at
    128 px still takes about the same 9 ms a step at batch 32 as at 256 (launch-bound)."""
    ref = largest * factor
    while ref > largest and model.trial_bytes(ref, model.image_size) > share * total_bytes:
        ref //= 2
    return max(ref, largest)


def busy_from_step_times(step_s: Mapping[int, float], batch: int) -> float:
    """`busy_fraction` of one worker at `batch` against the fastest rate (images/s) any
    probed batch reached; `step_s` maps batch size to median step seconds and holds
    `batch`. 1.0 (pack nothing) when `batch` was not timed."""
    timed = {b: t for b, t in step_s.items() if t > 0}
    if batch not in timed:
        return 1.0
    fastest = max(timed, key=lambda b: b / timed[b])
    return busy_fraction(timed[batch], batch, timed[fastest], fastest)


def workers_per_gpu(
    total_bytes: int,
    worst_trial_bytes: int,
    context_bytes: int,
    busy: float,
    max_workers: int = 8,
    headroom: float = HEADROOM,
) -> int:
    """Workers to place on one GPU: enough to keep it `TARGET_BUSY` when one worker alone
    keeps it `busy`, and no more than the worst trial's memory allows. At least one."""
    per_worker = max(1, worst_trial_bytes + context_bytes)
    by_memory = int(headroom * total_bytes // per_worker)
    by_compute = math.ceil(TARGET_BUSY / max(busy, 0.01))
    return max(1, min(by_memory, by_compute, max_workers))


def place_workers(per_gpu: Mapping[str, int]) -> list[str]:
    """One GPU id per worker, interleaved (0,1,0,1,...) so the first workers spread out."""
    out: list[str] = []
    left = dict(per_gpu)
    while any(left.values()):
        for gpu in per_gpu:
            if left[gpu] > 0:
                out.append(gpu)
                left[gpu] -= 1
    return out


def admit(
    need_bytes: int, reserved: Mapping[int, int], total_bytes: int, headroom: float = HEADROOM
) -> bool:
    """A trial may start on a GPU when its reservation fits beside the ones already there.

    A trial alone on its GPU always starts: if even that does not fit, the trainer records
    it as out-of-memory, which the sampler learns from.
    """
    if not reserved:
        return True
    return need_bytes + sum(reserved.values()) <= headroom * total_bytes


def mask_entries(mask: str) -> list[str]:
    """The GPUs a CUDA_VISIBLE_DEVICES value shows, read as CUDA reads it: up to the first
    entry that is not an index, a GPU-/MIG- UUID (prefix) or is repeated ("-1" hides every
    GPU; "0,-1,1" shows GPU 0 only)."""
    out: list[str] = []
    for raw in mask.split(","):
        entry = raw.strip()
        index = entry.isascii() and entry.isdigit()
        valid = index or (entry.upper().startswith(("GPU-", "MIG-")) and len(entry) > 4)
        if index:  # CUDA reads "00" as GPU 0 (a repeat, where it stops)
            entry = str(int(entry))
        if not valid or entry in out:
            break
        out.append(entry)
    return out


def visible_gpus(
    env: Mapping[str, str] | None = None, count: Callable[[], int] | None = None
) -> list[str]:
    """GPU ids workers may be placed on: CUDA_VISIBLE_DEVICES when set, else an index for
    every GPU NVML sees, else none. Workers read them in the order `gpu_env` gives them."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return mask_entries(env["CUDA_VISIBLE_DEVICES"])
    try:
        n = count() if count is not None else _nvml_count()
    except Exception:  # no driver, no NVML: no GPUs
        return []
    return [str(i) for i in range(n)]


def gpus_through_mask(requested: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """`--gpus` indices count the GPUs this process sees, as torch does: under
    CUDA_VISIBLE_DEVICES=2,3, `--gpus 1` is the machine's GPU 3, which a worker's own
    CUDA_VISIBLE_DEVICES must then name. An id that is not an index (a UUID, a MIG id) must
    be one of those visible (CUDA takes a unique prefix of one)."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" not in env:
        return list(requested)
    mask = env["CUDA_VISIBLE_DEVICES"]
    visible = mask_entries(mask)
    out = []
    for gpu in requested:
        if gpu.isdigit():
            if int(gpu) >= len(visible):
                raise DeviceError(
                    f"--gpus: {gpu}: only {len(visible)} GPU(s) visible "
                    f"(CUDA_VISIBLE_DEVICES={mask!r})"
                )
            out.append(visible[int(gpu)])
        elif any(v.startswith(gpu) or gpu.startswith(v) for v in visible if not v.isdigit()):
            out.append(gpu)
        else:
            raise DeviceError(
                f"--gpus: {gpu}: not among the visible GPUs (CUDA_VISIBLE_DEVICES={mask!r})"
            )
    return out


def gpu_env(env: Mapping[str, str], gpu: str | None) -> dict[str, str]:
    """The environment of a process the launcher places on `gpu` (a worker, the probe).
    `gpu` is one of `visible_gpus`. Without a CUDA_VISIBLE_DEVICES of the user's, those are
    NVML's indices, in PCI bus order, which CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA's too
    (CUDA's own default, FASTEST_FIRST, may differ on a machine with unlike GPUs). The
    user's mask and order are kept as they are: their mask means what it means to any CUDA
    program they run (fastest first unless they set an order). Telemetry finds the GPU by its
    UUID under another order (`tracking.gpu`)."""
    out = dict(env)
    if "CUDA_VISIBLE_DEVICES" not in env:
        out.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if gpu is not None:
        out["CUDA_VISIBLE_DEVICES"] = gpu
    return out


def _nvml_count() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


@dataclass(frozen=True)
class PackingPlan:
    """What `--workers auto` decided, and from which measurements (saved beside the run)."""

    gpus: list[str]
    workers_per_gpu: int
    total_bytes: int
    worst_trial_bytes: int
    busy: float
    models: list[MemoryModel]
    reason: str
    data_bytes: int = 0  # the decoded dataset each worker keeps on the GPU
    # Per GPU id, where GPUs differ or hold other jobs' memory: the bytes reservations
    # count against (free when the probe started) and the workers placed there. A GPU not
    # listed (a plan from an older version) takes `total_bytes` and `workers_per_gpu`.
    gpu_bytes: dict[str, int] = field(default_factory=dict)
    gpu_workers: dict[str, int] = field(default_factory=dict)

    def bytes_on(self, gpu: str) -> int:
        return self.gpu_bytes.get(gpu, self.total_bytes)

    def workers_on(self, gpu: str) -> int:
        return self.gpu_workers.get(gpu, self.workers_per_gpu)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> PackingPlan:
        raw = json.loads(text)
        raw["models"] = [MemoryModel(**m) for m in raw["models"]]
        return PackingPlan(**raw)

    def trial_bytes(self, arch: str, batch_size: int, image_size: int) -> int | None:
        for m in self.models:
            if m.arch == arch:
                return m.trial_bytes(batch_size, image_size) + m.context_bytes + self.data_bytes
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine still exists (signal 0 delivers nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat_fields(pid: int) -> list[bytes] | None:
    """`/proc/<pid>/stat` after "pid (comm) " (comm may hold spaces); None when unreadable."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].split()


def process_start(pid: int) -> int | None:
    """When a process of this machine started, in clock ticks since boot (`/proc/<pid>/stat`
    field 22): with its PID it names the process, where a PID alone may be reused after a
    crash or a reboot. None where /proc cannot tell (the process is gone, or not Linux)."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None  # field 22, 20th after comm
    except (IndexError, ValueError):
        return None


def holder_alive(pid: int, start: int | None, zombie_alive: bool = False) -> bool:
    """Whether the process that made a reservation (`pid`, started at `start` ticks, None
    when unknown) still runs: a live process under the same PID started later is another,
    and an exited one its parent has not reaped yet (a zombie, state Z or X) holds no
    memory: it kept its reservation, or its first place in line, until reaped.
    `zombie_alive`: a zombie counts as running (a server's leader, whose process group
    may still serve)."""
    if not pid_alive(pid):
        return False
    fields = _stat_fields(pid)  # read once: the state and the start time
    if fields is None:
        return True  # /proc cannot tell (not Linux): the PID alone
    if not zombie_alive and fields[0] in (b"Z", b"X"):
        return False
    try:
        return start is None or int(fields[19]) == start
    except (IndexError, ValueError):
        return True


def first_in_line(pid: int, since: float | None, waiting: Mapping[int, float]) -> bool:
    """Whether `pid`, waiting since `since` (s since the epoch; None: not waiting, one
    look), may be admitted before the trials `waiting` ({pid: since}) for the same GPU: the
    earliest goes first, ties by PID. A large trial is not passed for good by small ones
    that keep fitting beside each other (until it waits out its limit: then it is handed
    back and, asked again, goes behind the trials that came meanwhile)."""
    mine = (math.inf, pid) if since is None else (since, pid)
    return all((t, p) > mine for p, t in waiting.items() if p != pid)


def ledger_name(gpu: str) -> str:
    """A GPU id as a file name: a MIG id of the old form (MIG-GPU-<uuid>/1/0) holds
    slashes, which made the ledger's path a folder that does not exist (ValueError)."""
    return gpu.replace("/", "_")


@dataclass
class _Book:
    held: dict[int, int]  # {pid: bytes} of the trials running on the GPU
    waiting: dict[int, float]  # {pid: since, s since the epoch} of trials waiting for room
    starts: dict[int, int | None]  # {pid: start ticks} of both


class GpuLedger:
    """Memory reservations of the trials running on one GPU of this machine: a JSON file
    {pid: [bytes, start ticks]} under the work folder, changed under flock, beside one of
    the trials waiting for room {pid: [since, start ticks]}, served first come first served.
    Entries of dead processes are dropped, so a killed worker frees its reservation and its
    place in line; the start time keeps a PID reused after a crash or a reboot from holding
    a dead worker's."""

    def __init__(self, workdir: Path, gpu: str, total_bytes: int, headroom: float = HEADROOM):
        name = ledger_name(gpu)
        self.path = Path(workdir) / "gpu" / f"ledger-{name}.json"
        # apart from the ledger: older versions read every entry of it as {pid: [bytes, ...]}
        self.wait_path = self.path.with_name(f"waiting-{name}.json")
        self.total_bytes = total_bytes
        self.headroom = headroom

    def _read(self, path: Path, starts: dict[int, int | None]) -> dict[int, float]:
        try:
            raw = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            raw = {}
        out: dict[int, float] = {}
        for key, value in raw.items():
            # [value, start]; a bare number from an older version: start unknown
            got, start = (value[0], value[1]) if isinstance(value, list) else (value, None)
            if holder_alive(int(key), start):
                out[int(key)], starts[int(key)] = got, start
        return out

    def _write(
        self, path: Path, entries: Mapping[int, float], starts: dict[int, int | None]
    ) -> None:
        out = {
            str(p): [v, starts[p] if p in starts else process_start(p)] for p, v in entries.items()
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[_Book]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                starts: dict[int, int | None] = {}
                held = {p: int(b) for p, b in self._read(self.path, starts).items()}
                book = _Book(held, self._read(self.wait_path, starts), starts)
                yield book
                self._write(self.path, book.held, starts)
                if book.waiting or self.wait_path.exists():
                    self._write(self.wait_path, book.waiting, starts)
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def try_reserve(
        self, need_bytes: int, pid: int | None = None, since: float | None = None
    ) -> bool:
        """Reserve `need_bytes` for `pid` if they fit beside the trials running and no trial
        waits before it. `since` (s since the epoch): it waits in line from then, and a
        refusal keeps its place; None: one look, which waits behind every trial in line."""
        pid = os.getpid() if pid is None else pid
        with self._locked() as book:
            others = {p: b for p, b in book.held.items() if p != pid}
            first = first_in_line(pid, since, book.waiting)
            if not (first and admit(need_bytes, others, self.total_bytes, self.headroom)):
                if since is not None:
                    book.waiting[pid] = since
                return False
            book.held[pid] = need_bytes
            book.waiting.pop(pid, None)
            return True

    def leave_line(self, pid: int | None = None) -> None:
        """`pid` waits no longer (stopped, or given up): the trials behind it move up."""
        pid = os.getpid() if pid is None else pid
        with self._locked() as book:
            book.waiting.pop(pid, None)

    def release(self, pid: int | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        with self._locked() as book:
            book.held.pop(pid, None)
            book.waiting.pop(pid, None)

    def reserved(self) -> dict[int, int]:
        with self._locked() as book:
            return dict(book.held)

    def waiting(self) -> dict[int, float]:
        with self._locked() as book:
            return dict(book.waiting)

    @contextlib.contextmanager
    def reservation(
        self,
        need_bytes: int,
        should_stop: Callable[[], bool] = lambda: False,
        poll_s: float = 1.0,
        max_wait_s: float = 3600.0,
    ) -> Iterator[float]:
        """Hold `need_bytes` on this GPU while the block runs; yields the seconds waited.

        Waits in line while the GPU is full: trials that wait are admitted in the order they
        came, so a trial that keeps not fitting beside the others waits only for the trials
        running when it came. Raises AdmissionStopped (the trial is handed back untouched,
        to run later) when `should_stop` says so, or after `max_wait_s`: a neighbour that
        takes hours must not hang the worker, nor fail a trial that never ran."""
        t0 = time.monotonic()
        since = time.time()
        try:
            while not self.try_reserve(need_bytes, since=since):
                if should_stop():
                    raise AdmissionStopped(f"stopped after waiting {time.monotonic() - t0:.0f} s")
                if time.monotonic() - t0 > max_wait_s:
                    raise AdmissionStopped(
                        f"GPU memory: a trial needing {need_bytes // MiB} MiB waited "
                        f"{time.monotonic() - t0:.0f} s for room beside the trials packed "
                        "there; handed back to run later"
                    )
                time.sleep(poll_s)
        except BaseException:
            # A place kept would hold back every trial behind it while this worker does
            # something else (waits for the study's last trials, say): it is left.
            try:
                self.leave_line()
            except OSError as exc:  # the line file: what was raised matters more
                logger.warning("could not leave the GPU memory line: %s", exc)
            raise
        try:
            yield time.monotonic() - t0
        finally:
            try:
                self.release()
            except OSError as exc:  # a full disk: the trial's result matters more
                # Its hold stays until this process's next reservation replaces it, or the
                # process ends (a dead holder's hold is dropped).
                logger.warning("could not release the GPU memory reservation: %s", exc)


def plan_from_probe(
    gpus: Sequence[str],
    total_bytes: int,
    models: Sequence[MemoryModel],
    worst_trial_bytes: int,
    busy: float,
    max_per_gpu: int,
    data_bytes: int = 0,
    free_bytes: Sequence[int | None] = (),
    reserved_bytes: Mapping[str, int] | None = None,
) -> PackingPlan:
    """Workers per GPU from the probe's measurements. `free_bytes[i]` is GPU `gpus[i]`'s
    free memory when the probe started (None or missing: unknown, `total_bytes`, the first
    GPU's total, is used): GPUs of unlike sizes, or holding other jobs' memory, get workers
    by their own. Each GPU's ledger admits against that free memory plus
    `reserved_bytes[gpu]`, what other workers of the work folder hold in the same ledger
    (their memory is out of the free figure already)."""
    context = max((m.context_bytes for m in models), default=0) + data_bytes
    per_worker = max(1, worst_trial_bytes + context)
    free: dict[str, int] = {}
    room: dict[str, int] = {}
    for i, gpu in enumerate(gpus):
        known = free_bytes[i] if i < len(free_bytes) else None
        # A measured figure is that GPU's own, so it is not capped by `total_bytes`, the
        # first GPU's: a larger second card was planned as the first. What the work folder's
        # workers hold is added back up to that bound (a reservation not yet allocated is in
        # the free figure too: uncapped, a ledger could admit more than the card has).
        free[gpu] = total_bytes if known is None else int(known)
        held = (reserved_bytes or {}).get(gpu, 0) if known is not None else 0
        room[gpu] = min(free[gpu] + held, max(total_bytes, free[gpu]))
    counts = {
        g: workers_per_gpu(free[g], worst_trial_bytes, context, busy, max_per_gpu) for g in gpus
    }
    # A GPU that cannot hold the largest trial gets no worker: alone on it, that
    # trial would be admitted and run out of memory, and the sampler would learn that those
    # values fail. Unless no GPU can hold it: then each gets one, and such trials fail.
    measured_gpus = [
        g for i, g in enumerate(gpus) if i < len(free_bytes) and free_bytes[i] is not None
    ]
    # Judged as the ledger admits: with what this work folder's other workers hold added back
    # (their trials end; a trial of this launch waits for room rather than fail).
    short = [g for g in measured_gpus if HEADROOM * room[g] < per_worker]
    skipped = short if len(short) < len(gpus) else []
    for g in skipped:
        counts[g] = 0
    first = next((g for g in gpus if counts[g] > 0), gpus[0] if gpus else "")
    k = counts.get(first, workers_per_gpu(total_bytes, worst_trial_bytes, context, busy,
                                          max_per_gpu))  # fmt: skip
    by_memory = int(HEADROOM * free.get(first, total_bytes) // per_worker)
    why = "memory" if k == by_memory else ("compute" if k < max_per_gpu else "the cap")
    reason = (
        f"{k} workers per GPU on {len(gpus)} GPU(s): one worker keeps a GPU {busy:.0%} busy; "
        f"the largest trial needs {per_worker // MiB} MiB of "
        f"{free.get(first, total_bytes) // MiB} MiB free (limited by {why})"
    )
    if len(set(counts.values())) > 1:
        reason = (
            f"{sum(counts.values())} workers on {len(gpus)} GPU(s), "
            + ", ".join(f"{n} on {g} ({free[g] // MiB} MiB free)" for g, n in counts.items())
            + f": one worker keeps a GPU {busy:.0%} busy; the largest trial needs "
            f"{per_worker // MiB} MiB"
        )
    if skipped:
        reason += "; no worker on " + ", ".join(f"{g} ({free[g] // MiB} MiB free)" for g in short)
    elif short:
        reason += "; no GPU has room for the largest trial: such trials run out of memory"
    measured = any(f is not None for f in free_bytes)
    return PackingPlan(
        list(gpus), k, total_bytes, worst_trial_bytes, busy, list(models), reason, data_bytes,
        gpu_bytes=room if measured else {}, gpu_workers=counts if measured else {},
    )  # fmt: skip
