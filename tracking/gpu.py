"""GPU telemetry for one worker, with nvidia-ml-py (``pynvml``).

A background thread samples ONLY the GPUs this worker was given (``CUDA_VISIBLE_DEVICES``:
indices, ``GPU-<uuid>`` (prefixes too) or ``MIG-<uuid>`` entries) every ``interval_s`` seconds
and hands each sample to a sink, normally :meth:`TrialTracker.log_system`:

=================================  =========================================================
``system/gpu_utilization``         device SM utilization, %
``system/gpu_process_utilization`` this worker's SM utilization, % (see below)
``system/gpu_memory_mib``          device memory used, MiB
``system/gpu_process_memory_mib``  this worker's memory, MiB (when NVML reports it)
``system/gpu_power_w``             board power, W
``system/gpu_temperature_c``       GPU temperature, °C
``system/gpu_sm_clock_mhz``        SM clock, MHz
=================================  =========================================================

Process-level values are logged (and used by the input-bound rule) only once the NVML query
that gives them has listed this worker's PID: in a container without the host PID namespace
NVML reports host PIDs (for one query and not the other on some drivers), and the device
values are used instead.

With several GPUs every name gets a ``_<nvml index>`` suffix (``_mig<k>`` for MIG entries).
Summaries (:meth:`GpuSampler.summary`): mean utilization, peak memory, energy in J (NVML's
energy counter delta where supported, else power integrated over time).

Input-bound rule: once ``window_s`` seconds of samples (after ``warmup_s``) exist, if the mean
utilization over the last ``window_s`` seconds (this process's utilization when available, since
trials may share a GPU; on a saturated GPU, at least ``SATURATED_PCT`` busy, times the number of
processes busy on it in that sample, since they take turns: K busy packed workers read about
100/K % each; else the device's) is below
``threshold_pct``, the sampler flags the trial once (warning + ``on_input_bound(mean)``); with
``stop_when_input_bound`` its :meth:`GpuSampler.should_stop` turns True so the trainer can stop
the trial.

Without NVML or without a visible GPU nothing GPU-related is logged; a warning is logged once
per process, and nothing raises.

CUDA numbers devices fastest-first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; NVML numbers them
by PCI bus. The launcher sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` for its workers unless the user
set a mask or an order (theirs keep the meaning CUDA gives them). Under another order, with
several GPUs and an index in ``CUDA_VISIBLE_DEVICES``, the sampler asks CUDA (through torch)
for the UUIDs of the GPUs it sees, so that it samples the GPU the trial runs on.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any, Protocol

from hpsearch.tracking import logger

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6  # nvmlDeviceGetProcessUtilization: no sample since the time given
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
MIB = 1024 * 1024
SATURATED_PCT = 90.0  # device utilization, %, from which processes sharing it wait on each other

Sink = Callable[[Mapping[str, float]], None]

_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str, *args: object) -> bool:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    with _warned_lock:
        if key in _warned:
            return False
        _warned.add(key)
    logger.warning(message, *args)
    return True


def reset_warnings() -> None:
    """Forget which once-only warnings were given (tests)."""
    with _warned_lock:
        _warned.clear()


# --------------------------------------------------------------------------- pure helpers

DeviceRef = int | str  # NVML index of a whole GPU, or a MIG UUID


def nvml_handle(nvml: Any, ref: DeviceRef) -> Any:
    """NVML's handle of a `DeviceRef`: by index for a whole GPU, by UUID for a MIG one."""
    if isinstance(ref, int):
        return nvml.nvmlDeviceGetHandleByIndex(ref)
    return nvml.nvmlDeviceGetHandleByUUID(ref)


def resolve_visible_devices(value: str | None, gpu_uuids: Sequence[str]) -> list[DeviceRef]:
    """Map ``CUDA_VISIBLE_DEVICES`` to the GPUs NVML knows (``gpu_uuids[i]`` is the UUID of NVML
    index ``i``), in CUDA's order.

    * unset (None): every GPU; empty string: none;
    * ``"2"`` -> NVML index 2; ``"GPU-8f2c..."`` (a unique prefix is enough) -> its index;
    * ``"MIG-..."`` -> the MIG UUID itself (looked up with ``nvmlDeviceGetHandleByUUID``);
    * like CUDA, parsing stops at the first invalid, unknown or repeated entry (``"0,-1,1"``
      -> ``[0]``; ``"-1"`` -> no GPU).
    """
    if value is None:
        return list(range(len(gpu_uuids)))
    out: list[DeviceRef] = []
    for raw in value.split(","):
        entry = raw.strip()
        ref: DeviceRef | None = None
        if entry.isdigit():
            index = int(entry)
            ref = index if index < len(gpu_uuids) else None
        elif entry.upper().startswith("GPU-"):
            matches = [i for i, u in enumerate(gpu_uuids) if u.upper().startswith(entry.upper())]
            ref = matches[0] if len(matches) == 1 else None
        elif entry.upper().startswith("MIG-") and len(entry) > 4:
            ref = entry
        if ref is None or ref in out:
            break
        out.append(ref)
    return out


def _uuid_hex(uuid: str) -> str:
    """A UUID's 32 hex digits, lower case: NVML writes ``GPU-8f2c...-...``, torch ``8f2c...``."""
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text.replace("-", "")


def cuda_order_differs(value: str | None, order: str | None, n_gpus: int) -> bool:
    """Whether an index in ``CUDA_VISIBLE_DEVICES`` (``value``) may name another GPU to CUDA
    than to NVML: with more than one GPU, an index entry, and a ``CUDA_DEVICE_ORDER``
    (``order``; unset is CUDA's FASTEST_FIRST) other than PCI_BUS_ID, NVML's order."""
    if n_gpus < 2 or value is None:
        return False
    if (order or "FASTEST_FIRST").strip().upper() == "PCI_BUS_ID":
        return False
    return any(entry.strip().isdigit() for entry in value.split(","))


def refs_by_uuid(cuda_uuids: Sequence[str], gpu_uuids: Sequence[str]) -> list[DeviceRef]:
    """The devices CUDA lists (``cuda_uuids``, in CUDA's order) as `resolve_visible_devices`
    names them: a whole GPU by its NVML index (``gpu_uuids[i]`` is index ``i``'s UUID), a
    UUID NVML does not list as a whole GPU by ``MIG-<uuid>`` (CUDA gives a MIG instance the
    UUID NVML knows it by). Stops at a malformed or repeated UUID, as CUDA's parsing does."""
    index = {_uuid_hex(u): i for i, u in enumerate(gpu_uuids)}
    out: list[DeviceRef] = []
    for uuid in cuda_uuids:
        digits = _uuid_hex(uuid)
        found: DeviceRef | None = index.get(digits)
        if found is None and len(digits) == 32 and all(c in "0123456789abcdef" for c in digits):
            d = digits
            found = f"MIG-{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:]}"
        if found is None or found in out:
            break
        out.append(found)
    return out


def nvml_uuids(nvml: Any) -> list[str]:
    """The UUID of every GPU NVML lists, by NVML index (``nvml``: the pynvml module or a
    fake of it, initialised); "" for one this process may not open: NVML counts every GPU
    of the machine, also those a cgroup (Slurm, a container) keeps from it."""

    def uuid(i: int) -> str:
        try:
            return _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
        except Exception as exc:
            if nvml_error_code(exc) == NVML_ERROR_NO_PERMISSION:
                return ""
            raise

    return [uuid(i) for i in range(int(nvml.nvmlDeviceGetCount()))]


def torch_cuda_uuids() -> list[str] | None:
    """The UUIDs of the GPUs CUDA shows this process, in CUDA's order, from torch (imported
    here if it is not yet: only where CUDA's order and NVML's may differ, in a process that
    trains on one of these GPUs). None without torch or CUDA. Initialises CUDA."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        return [
            str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
        ]
    except Exception:  # a broken CUDA set-up: the caller falls back to NVML's order
        return None


def device_labels(refs: Sequence[DeviceRef]) -> list[str]:
    """Metric-name suffixes: ``""`` for a single device, else ``_<index>`` / ``_mig<k>``."""
    if len(refs) <= 1:
        return [""] * len(refs)
    labels: list[str] = []
    mig = 0
    for ref in refs:
        if isinstance(ref, int):
            labels.append(f"_{ref}")
        else:
            labels.append(f"_mig{mig}")
            mig += 1
    return labels


def is_input_bound(
    samples: Sequence[tuple[float, float]],
    now: float,
    window_s: float,
    threshold_pct: float,
    history_start: float,
) -> tuple[bool, float | None]:
    """(flag, mean utilization over ``(now - window_s, now]``). No decision (False, None) until
    ``window_s`` seconds have passed since ``history_start`` (the first counted sample) or when
    the window holds no sample."""
    if now - history_start < window_s:
        return False, None
    values = [u for t, u in samples if t > now - window_s]
    if not values:
        return False, None
    mean = sum(values) / len(values)
    return mean < threshold_pct, mean


def share_scaled_utilization(process_pct: float, active_processes: int) -> float:
    """This process's SM utilization (%) scaled to the GPU it would use alone: processes on one
    GPU (without MPS) are time-sliced, so each of K busy ones reads about 100/K %. Capped at
    100 %. ``active_processes`` counts the processes NVML sampled as busy, this one included."""
    return min(100.0, process_pct * max(1, active_processes))


def integrate_power(samples: Sequence[tuple[float, float]]) -> float:
    """Energy in J from (time s, power W) samples, trapezoid rule."""
    energy = 0.0
    for (t0, p0), (t1, p1) in itertools.pairwise(samples):
        energy += (t1 - t0) * (p0 + p1) / 2.0
    return energy


def nvml_error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


# --------------------------------------------------------------------------- the sampler


@dataclass
class _DeviceStats:
    ref: DeviceRef
    label: str
    handle: Any
    util_sum: float = 0.0
    util_n: int = 0
    proc_util_sum: float = 0.0
    proc_util_n: int = 0
    proc_util_supported: bool = True
    proc_mem_supported: bool = True
    # NVML listed this worker's PID at least once, per query: drivers can answer the two
    # queries in different PID namespaces inside a container (host PIDs in one, the
    # container's in the other), so one query's sighting says nothing about the other's.
    util_pid_seen: bool = False
    mem_pid_seen: bool = False
    proc_active_n: int = 1  # processes with a utilization sample in the last query
    last_proc_ts: int = 0  # NVML µs timestamp of the newest process sample seen
    mem_peak_mib: float = 0.0
    proc_mem_peak_mib: float = 0.0
    energy_start_mj: float | None = None
    energy_last_mj: float | None = None
    power: list[tuple[float, float]] = field(default_factory=list)


class TrackerLike(Protocol):
    def log_system(self, metrics: Mapping[str, float], timestamp_ms: int | None = None) -> None:
        """Buffer one sample of system metrics."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the run."""


class GpuSampler:
    """Samples this worker's GPUs in a background thread. ``nvml`` is the ``pynvml`` module
    (imported lazily by default) or a fake with the same functions (tests)."""

    def __init__(
        self,
        sink: Sink | None = None,
        *,
        interval_s: float = 5.0,
        window_s: float = 60.0,
        threshold_pct: float = 50.0,
        warmup_s: float = 30.0,
        stop_when_input_bound: bool = False,
        on_input_bound: Callable[[float], None] | None = None,
        pid: int | None = None,
        visible_devices: str | None = None,
        use_env: bool = True,
        nvml: Any = None,
        clock: Callable[[], float] = time.monotonic,
        device_order: str | None = None,
        cuda_uuids: Callable[[], Sequence[str] | None] = torch_cuda_uuids,
        trial_device: int | None = 0,
        paused: bool = False,
    ) -> None:
        """``trial_device``: the visible GPU the trial trains on (``cuda:N``), the only one
        the input-bound rule judges; None for a trial on the CPU, which samples nothing
        (see `trial_gpu_index`). ``paused``: the rule judges nothing until
        :meth:`restart_warmup` (a trial's set-up and its compiling first epoch leave the
        GPU idle); samples are taken and logged from the start.
        ``visible_devices`` overrides ``$CUDA_VISIBLE_DEVICES``; with ``use_env=False`` and
        no value every GPU is sampled. ``device_order`` is the order its indices count in:
        ``$CUDA_DEVICE_ORDER`` for the environment's value (unset: CUDA's FASTEST_FIRST),
        else NVML's (PCI_BUS_ID).
        ``cuda_uuids`` lists the GPUs CUDA sees, for an order other than NVML's."""
        self.sink = sink
        self.interval_s = interval_s
        self.window_s = window_s
        self.threshold_pct = threshold_pct
        self.warmup_s = warmup_s
        self.stop_when_input_bound = stop_when_input_bound
        self.on_input_bound = on_input_bound
        self.pid = os.getpid() if pid is None else pid
        # No mask in the environment: the trainer uses CUDA's first device (cuda:0), the one
        # GPU of the machine's that is this trial's.
        self._first_only = False
        if visible_devices is None and use_env:
            visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
            self._first_only = visible_devices is None
            if device_order is None:  # unset: CUDA's own default
                device_order = os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
        self.visible_devices = visible_devices
        self.device_order = "PCI_BUS_ID" if device_order is None else device_order
        self._cuda_uuids = cuda_uuids
        self.clock = clock
        self.input_bound = False  # flagged once (the run's tag): see `should_stop`
        self.input_bound_mean: float | None = None
        self._bound_now = False  # the latest judgment of the rule
        self.samples_taken = 0
        self.trial_device = trial_device
        # The index in the sampled devices of the trial's own: its cuda:N of the mask, or
        # the one device sampled without a mask (`_cudas_own`).
        self._own = trial_device
        self._nvml = nvml
        self._devices: list[_DeviceStats] = []
        self._initialized = False
        self._started_at: float | None = None
        self._paused = paused  # no rule judged until restart_warmup
        self._restart_at: float | None = None  # restart_warmup's time, until applied
        self._history: deque[tuple[float, float]] = deque()
        self._history_start: float | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """True when NVML works and at least one visible GPU was found."""
        return bool(self._devices)

    @property
    def device_refs(self) -> list[DeviceRef]:
        return [d.ref for d in self._devices]

    def open(self) -> bool:
        """Initialise NVML and resolve the visible GPUs (no thread). False when unavailable."""
        if self._initialized:
            return self.available
        self._initialized = True
        self._started_at = self.clock()
        if self.trial_device is None:  # a CPU trial: a GPU's figures are not its own
            return False
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            nvml = self._nvml
            nvml.nvmlInit()
        except Exception as exc:  # no driver / no library: telemetry is optional
            warn_once("nvml", "GPU telemetry off: NVML is not available (%s)", exc)
            self._nvml = None
            return False
        try:
            uuids = nvml_uuids(nvml)
            refs = resolve_visible_devices(self.visible_devices, uuids)
            by_index = self.visible_devices is None or any(
                e.strip().isdigit() for e in self.visible_devices.split(",")
            )
            if "" in uuids and by_index:  # a GPU hidden from this process: NVML's indices
                refs = self._through_cuda(uuids)  # are not CUDA's (UUID entries are sound)
            elif self._first_only and len(uuids) > 1:
                refs = self._cudas_own(uuids)
            elif cuda_order_differs(self.visible_devices, self.device_order, len(uuids)):
                cuda = self._cuda_uuids()
                by_uuid = refs_by_uuid(cuda, uuids) if cuda else []
                if by_uuid:
                    refs = by_uuid
                else:
                    warn_once(
                        "cuda-order",
                        "GPU telemetry: CUDA_DEVICE_ORDER=%s may number GPUs unlike NVML and "
                        "CUDA's devices (%s) are not known to NVML here; "
                        "CUDA_VISIBLE_DEVICES=%r is read in NVML's (PCI bus) order",
                        self.device_order,
                        ", ".join(cuda or []) or "none listed",
                        self.visible_devices,
                    )
            labels = device_labels(refs)
            for ref, label in zip(refs, labels, strict=True):
                handle = nvml_handle(nvml, ref)
                dev = _DeviceStats(ref=ref, label=label, handle=handle)
                try:
                    dev.energy_start_mj = float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
                except Exception:  # not supported on this GPU: integrate power instead
                    dev.energy_start_mj = None
                # NVML answers a first query (timestamp 0) from its whole sample buffer:
                # seconds of this PID's previous trial, or of processes since gone.
                self._process_utilization(dev)
                dev.util_pid_seen = False
                self._devices.append(dev)
        except Exception as exc:  # telemetry is optional
            warn_once("nvml-devices", "GPU telemetry off: cannot list GPUs with NVML (%s)", exc)
            self._devices = []
        if not self._devices:
            warn_once(
                "no-gpu",
                "GPU telemetry off: no visible GPU (CUDA_VISIBLE_DEVICES=%r)",
                self.visible_devices,
            )
            self._shutdown_nvml()
            return False
        return True

    def _through_cuda(self, uuids: Sequence[str]) -> list[DeviceRef]:
        """The GPUs CUDA shows this process (the trial's only, without a mask), found by
        their UUIDs: NVML counts every GPU of the machine, a cgroup's hidden ones too
        (Slurm's ConstrainDevices), so its indices and CUDA's differ. None without torch's
        UUIDs."""
        cuda = list(self._cuda_uuids() or [])
        if self._first_only:
            k = self.trial_device or 0
            cuda, self._own = cuda[k : k + 1], 0
        refs = refs_by_uuid(cuda, uuids)
        if not refs:
            warn_once(
                "cuda-hidden",
                "GPU telemetry off: NVML lists GPUs this process may not open, and CUDA's "
                "devices are not known to NVML here to tell which is the trial's",
            )
        return refs

    def _cudas_own(self, uuids: Sequence[str]) -> list[DeviceRef]:
        """The trial's CUDA device (cuda:N, `trial_device`) among NVML's GPUs (CUDA numbers
        them fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, NVML's order): found by its
        UUID where torch gives it. It is then the one device sampled (`_own` 0)."""
        k = self.trial_device or 0
        self._own = 0
        if (self.device_order or "").strip().upper() == "PCI_BUS_ID":
            return [k] if k < len(uuids) else [0]
        cuda = self._cuda_uuids()
        found = refs_by_uuid(list(cuda or [])[k : k + 1], uuids)
        if found:
            return found
        warn_once(
            "cuda-first",
            "GPU telemetry: CUDA_VISIBLE_DEVICES is unset on a machine of %d GPUs and CUDA's "
            "device %d is not known to NVML here; NVML's GPU %d is sampled as the trial's",
            len(uuids),
            k,
            k if k < len(uuids) else 0,
        )
        return [k] if k < len(uuids) else [0]

    def start(self) -> bool:
        """Open NVML and start the sampling thread. False (and nothing logged) without a GPU."""
        if not self.open():
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self._thread.start()
        return True

    def stop(self) -> dict[str, float]:
        """Stop the thread, read the energy (or power) up to now, release NVML; returns
        :meth:`summary`. A thread stuck in an NVML call is not waited for past a timeout."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.interval_s * 2))
            if self._thread.is_alive():  # an NVML call hangs (a GPU off the bus), holding
                # the lock that the summary takes: the trial ends without one
                warn_once("gpu-hang", "GPU telemetry: NVML does not answer; no GPU summary")
                return {}
            self._thread = None
            # its last act was reading the energy up to now (_run)
        elif self._devices and self.samples_taken == 0:
            self.sample_once()
        elif self._devices:
            self._read_energy()
        summary = self.summary()
        self._shutdown_nvml()
        return summary

    def __enter__(self) -> GpuSampler:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def pause_rule(self) -> None:
        """Judge no input-bound rule until :meth:`restart_warmup`: a packed trial waiting for
        GPU memory runs no work of its own, so its idle GPU says nothing about its input
        pipeline (a wait longer than the warm-up and the window flagged it, and stopped it
        at its first report). Samples are still taken and logged.

        Takes no lock (nor does :meth:`restart_warmup`): the training thread calls both, and
        the sampler's thread holds the lock through its NVML calls, which may hang."""
        self._restart_at = None
        self._paused = True

    def restart_warmup(self) -> None:
        """Judge the input-bound rule from now on (applied at the next sample), after a new
        warm-up, forgetting the samples before: the trial's work starts now, or runs at
        speed. A flag raised before stays on record (the run's tag) but stops nothing."""
        self._restart_at = self.clock()
        self._bound_now = False

    def should_stop(self) -> bool:
        """True when the policy asks to stop input-bound trials and this one is input-bound
        over the latest window (not once: a first epoch that read a cold disk and then ran
        from the page cache is not stopped for it)."""
        return self.stop_when_input_bound and self._restart_at is None and self._bound_now

    # -- sampling -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)
        self._read_energy()  # up to the stop, not to the last period's sample

    def _read_energy(self) -> None:
        """The energy counters (or a power reading), outside any sample: the GPU is idle
        after training, and such a sample would weigh on the rule and the utilization."""
        try:
            with self._lock:
                t = self.clock()
                for dev in self._devices:
                    nvml, h = self._nvml, dev.handle
                    if dev.energy_start_mj is not None:
                        energy = _try(partial(nvml.nvmlDeviceGetTotalEnergyConsumption, h))
                        if energy is not None:
                            dev.energy_last_mj = float(energy)
                    elif (power_mw := _try(partial(nvml.nvmlDeviceGetPowerUsage, h))) is not None:
                        dev.power.append((t, float(power_mw) / 1000.0))
        except Exception as exc:  # telemetry never kills training
            warn_once("gpu-energy", "GPU telemetry: reading the energy failed (%s)", exc)

    def sample_once(self, now: float | None = None) -> dict[str, float]:
        """Take one sample of every device, update the summaries and the input-bound rule,
        send it to the sink. Never raises; returns the metrics sent (empty without GPUs)."""
        if not self._devices or self._nvml is None:
            return {}
        try:
            with self._lock:
                t = self.clock() if now is None else now
                metrics: dict[str, float] = {}
                judged: float | None = None
                for i, dev in enumerate(self._devices):
                    util = self._sample_device(dev, t, metrics)
                    if i == self._own:
                        # Its own GPU only: beside another visible one it does not use (a
                        # mask of two, cuda:0 training), the mean of 90% and 0% was flagged.
                        judged = util
                self.samples_taken += 1
                if judged is not None:
                    self._update_input_bound(t, judged)
        except Exception as exc:  # telemetry never kills training
            warn_once("gpu-sample", "GPU telemetry: sampling failed (%s)", exc)
            return {}
        if metrics and self.sink is not None:
            try:
                self.sink(metrics)
            except Exception as exc:  # telemetry never kills training
                warn_once("gpu-sink", "GPU telemetry: the sink failed (%s)", exc)
        return metrics

    def _sample_device(self, dev: _DeviceStats, t: float, out: dict[str, float]) -> float | None:
        """Sample one device into ``out``; returns the utilization the input-bound rule uses."""
        nvml = self._nvml
        h = dev.handle
        sfx = dev.label
        util: float | None = None
        proc_util: float | None = None

        rates = _try(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        if rates is not None:
            util = float(rates.gpu)
            out[f"system/gpu_utilization{sfx}"] = util
            dev.util_sum += util
            dev.util_n += 1
        # Process-level numbers only count once that query has shown this worker's PID (inside
        # a container without the host PID namespace it may never: NVML reports host PIDs, and
        # a constant 0 % would wrongly flag every trial input-bound).
        proc_mem = self._process_memory(dev) if dev.proc_mem_supported else None
        if dev.proc_util_supported:
            proc_util = self._process_utilization(dev)
        if not dev.util_pid_seen:
            proc_util = None
        if not dev.mem_pid_seen:
            proc_mem = None
        if proc_util is not None:
            out[f"system/gpu_process_utilization{sfx}"] = proc_util
            dev.proc_util_sum += proc_util
            dev.proc_util_n += 1
        mem = _try(lambda: nvml.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            used = float(mem.used) / MIB
            out[f"system/gpu_memory_mib{sfx}"] = used
            dev.mem_peak_mib = max(dev.mem_peak_mib, used)
        if proc_mem is not None:
            out[f"system/gpu_process_memory_mib{sfx}"] = proc_mem
            dev.proc_mem_peak_mib = max(dev.proc_mem_peak_mib, proc_mem)
        power_mw = _try(lambda: nvml.nvmlDeviceGetPowerUsage(h))
        if power_mw is not None:
            watts = float(power_mw) / 1000.0
            out[f"system/gpu_power_w{sfx}"] = watts
            dev.power.append((t, watts))
        temp = _try(lambda: nvml.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU))
        if temp is not None:
            out[f"system/gpu_temperature_c{sfx}"] = float(temp)
        clock = _try(lambda: nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM))
        if clock is not None:
            out[f"system/gpu_sm_clock_mhz{sfx}"] = float(clock)
        if dev.energy_start_mj is not None:
            energy = _try(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h))
            if energy is not None:
                dev.energy_last_mj = float(energy)
        if proc_util is None:
            return util
        # Processes sharing a saturated GPU take turns on it: K busy packed workers read about
        # 100/K % each, a full share. On a GPU with time to spare they do not wait for each
        # other, and each one's own figure is what it would read alone.
        if util is not None and util >= SATURATED_PCT:
            return share_scaled_utilization(proc_util, dev.proc_active_n)
        return proc_util

    def _process_utilization(self, dev: _DeviceStats) -> float | None:
        nvml = self._nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(dev.handle, dev.last_proc_ts)
        except Exception as exc:
            code = nvml_error_code(exc)
            if code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION):
                dev.proc_util_supported = False
                return None
            if code == NVML_ERROR_NOT_FOUND:  # no sample since last time: no process ran
                return 0.0
            return None  # a failed query (a timeout, a lost GPU, a race sizing pynvml's
            # buffer) says nothing: not an idle sample for the rule
        fresh = [s for s in samples if int(s.timeStamp) > dev.last_proc_ts]
        mine = [s for s in fresh if int(s.pid) == self.pid]
        if samples:
            dev.last_proc_ts = max(dev.last_proc_ts, *(int(s.timeStamp) for s in samples))
        dev.proc_active_n = max(1, len({int(s.pid) for s in fresh if float(s.smUtil) > 0}))
        if not mine:
            return 0.0
        dev.util_pid_seen = True
        return float(sum(float(s.smUtil) for s in mine) / len(mine))

    def _process_memory(self, dev: _DeviceStats) -> float | None:
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(dev.handle)
        except Exception as exc:
            if nvml_error_code(exc) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION):
                dev.proc_mem_supported = False
            return None  # else one failed query (a timeout): the next sample asks again
        used = [p.usedGpuMemory for p in procs if int(p.pid) == self.pid]
        if not used:
            return 0.0
        dev.mem_pid_seen = True
        if any(u is None for u in used):  # NVML hides it (e.g. containers without PID ns)
            dev.proc_mem_supported = False
            return None
        return float(sum(used)) / MIB

    def _update_input_bound(self, t: float, util: float) -> None:
        restart = self._restart_at
        if restart is not None:  # restart_warmup, applied here under the lock
            self._started_at = restart
            self._history.clear()
            self._history_start = None
            self._bound_now = False
            if self._restart_at is restart:  # no pause_rule nor a new restart meanwhile
                self._restart_at = None
                self._paused = False
        if self._paused:
            return
        start = self._started_at if self._started_at is not None else t
        if t - start < self.warmup_s:
            return
        if self._history_start is None:
            self._history_start = t
        self._history.append((t, util))
        while self._history and self._history[0][0] <= t - self.window_s:
            self._history.popleft()
        flag, mean = is_input_bound(
            list(self._history), t, self.window_s, self.threshold_pct, self._history_start
        )
        self._bound_now = flag
        if flag and not self.input_bound and mean is not None:
            self.input_bound = True
            self.input_bound_mean = mean
            logger.warning(
                "GPU utilization averaged %.0f%% over the last %.0f s (< %.0f%%): the trial "
                "looks input-bound (data loading)%s",
                mean,
                self.window_s,
                self.threshold_pct,
                "; asking to stop it" if self.stop_when_input_bound else "",
            )
            if self.on_input_bound is not None:
                try:
                    self.on_input_bound(mean)
                except Exception as exc:  # telemetry never kills training
                    warn_once("gpu-callback", "GPU telemetry: on_input_bound failed (%s)", exc)

    # -- summaries ----------------------------------------------------------------------------

    def summary(self) -> dict[str, float]:
        """``system/gpu_utilization_mean``, ``system/gpu_process_utilization_mean``,
        ``system/gpu_memory_peak_mib``, ``system/gpu_process_memory_peak_mib``,
        ``system/gpu_energy_j`` (suffixed per device when several, and unsuffixed for the
        trial's own, `trial_device`). Empty without GPUs."""
        out: dict[str, float] = {}
        with self._lock:
            devs = list(self._devices)
            for dev in devs:
                sfx = dev.label
                if dev.util_n:
                    out[f"system/gpu_utilization_mean{sfx}"] = dev.util_sum / dev.util_n
                if dev.proc_util_n:
                    out[f"system/gpu_process_utilization_mean{sfx}"] = (
                        dev.proc_util_sum / dev.proc_util_n
                    )
                if dev.util_n or dev.mem_peak_mib:
                    out[f"system/gpu_memory_peak_mib{sfx}"] = dev.mem_peak_mib
                if dev.proc_mem_peak_mib:  # measured, even if the query stopped working
                    out[f"system/gpu_process_memory_peak_mib{sfx}"] = dev.proc_mem_peak_mib
                energy = _energy_j(dev)
                if energy is not None:
                    out[f"system/gpu_energy_j{sfx}"] = energy
            # Unsuffixed: the trial's own GPU's (cuda:N of the mask), the one it trains on;
            # a mean or sum with a visible GPU it does not use read 45% for a GPU at 90%.
            own = self._own
            if len(devs) > 1 and own is not None and 0 <= own < len(devs):
                for name in ("gpu_utilization_mean", "gpu_process_utilization_mean",
                             "gpu_memory_peak_mib", "gpu_process_memory_peak_mib",
                             "gpu_energy_j"):  # fmt: skip
                    if (key := f"system/{name}{devs[own].label}") in out:
                        out[f"system/{name}"] = out[key]
        if self.input_bound_mean is not None:
            out["system/gpu_input_bound_utilization"] = self.input_bound_mean
        return out

    def _shutdown_nvml(self) -> None:
        nvml = self._nvml
        if nvml is None:
            return
        self._nvml = None
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _energy_j(dev: _DeviceStats) -> float | None:
    if dev.energy_start_mj is not None and dev.energy_last_mj is not None:
        return max(0.0, dev.energy_last_mj - dev.energy_start_mj) / 1000.0
    if len(dev.power) >= 2:
        return integrate_power(dev.power)
    return None


def _try(fn: Callable[[], Any]) -> Any:
    """One NVML query; None when the GPU does not support it (MIG, old boards) or it fails."""
    try:
        return fn()
    except Exception:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class TrackerRelay:
    """A sampler's sink and input-bound hook before its tracker exists (a trial that trains
    before its MLflow run starts): samples keep the time they were taken and a raised flag
    is kept, both at most ``limit`` deep, until :meth:`attach` hands them to the tracker;
    later ones go straight to it. Thread-safe (the sampler's thread calls it)."""

    def __init__(
        self, on_input_bound: Callable[[float], None] | None = None, limit: int = 1000
    ) -> None:
        self._lock = threading.Lock()
        self._tracker: TrackerLike | None = None
        self._samples: deque[tuple[dict[str, float], int]] = deque(maxlen=limit)
        self._input_bound: float | None = None
        self._user_cb = on_input_bound

    def __call__(self, metrics: Mapping[str, float]) -> None:
        with self._lock:
            if self._tracker is None:
                self._samples.append((dict(metrics), int(time.time() * 1000)))  # ms
                return
            self._tracker.log_system(metrics)

    def flag(self, mean: float) -> None:
        """The sampler's ``on_input_bound``: tags the run ``hpsearch.input_bound=true``."""
        with self._lock:
            if self._tracker is None:
                self._input_bound = mean
            else:
                self._tag(self._tracker, mean)
        if self._user_cb is not None:
            self._user_cb(mean)

    def attach(self, tracker: TrackerLike) -> None:
        """Send what was kept to ``tracker`` (in order, with its times), then forward."""
        with self._lock:  # held: a new sample must not overtake the kept ones
            for metrics, ts_ms in self._samples:
                tracker.log_system(metrics, ts_ms)
            self._samples.clear()
            if self._input_bound is not None:
                self._tag(tracker, self._input_bound)
            self._tracker = tracker

    @staticmethod
    def _tag(tracker: TrackerLike, mean: float) -> None:
        tracker.set_tags(
            {"hpsearch.input_bound": "true", "hpsearch.input_bound_utilization": f"{mean:.1f}"}
        )


def trial_gpu_index(device: str, cuda_available: bool) -> int | None:
    """The visible GPU a trial on `device` (a worker's --device) trains on, as the trainer
    resolves it: None on the CPU (`cpu`, or `auto` without CUDA); N for `cuda:N`; else 0."""
    if device == "cpu" or (device == "auto" and not cuda_available):
        return None
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return 0


def relayed_sampler(**kwargs: Any) -> tuple[GpuSampler, TrackerRelay]:
    """A GpuSampler that can start before its tracker exists; ``relay.attach(tracker)``
    sends its samples and its input-bound flag to the tracker from then on."""
    relay = TrackerRelay(kwargs.pop("on_input_bound", None))
    return GpuSampler(relay, on_input_bound=relay.flag, **kwargs), relay


def sampler_for_tracker(tracker: TrackerLike, **kwargs: Any) -> GpuSampler:
    """A GpuSampler whose samples go to ``tracker.log_system`` and whose input-bound flag sets
    ``hpsearch.input_bound=true`` on the run. Call ``.start()`` / ``.stop()`` around training
    and log ``.stop()``'s summary with the trial's summary metrics."""
    sampler, relay = relayed_sampler(**kwargs)
    relay.attach(tracker)
    return sampler


__all__ = [
    "DeviceRef",
    "GpuSampler",
    "TrackerRelay",
    "cuda_order_differs",
    "device_labels",
    "integrate_power",
    "is_input_bound",
    "nvml_uuids",
    "refs_by_uuid",
    "relayed_sampler",
    "reset_warnings",
    "resolve_visible_devices",
    "sampler_for_tracker",
    "torch_cuda_uuids",
    "trial_gpu_index",
    "warn_once",
]
