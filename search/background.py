"""Background work that must not slow training down."""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

NICE = 10  # added to a background thread's nice value
T = TypeVar("T")


def lower_priority(idle: bool = False) -> None:
    """Call first thing in a background thread (MLflow set-up and uploads, plots, checkpoint
    writes). On Linux a thread has its own nice value and scheduling policy.

    Its nice value is raised by NICE: the thread gets less CPU time than training threads,
    but still a share when they fill every core, so work that others wait for with a time
    limit while training goes on (a run's ending and uploads, plots, the launcher's study
    run) is never starved.

    With `idle`, the thread also takes SCHED_IDLE (any unprivileged thread may): it runs
    only in CPU time that training leaves idle. A nice value alone still lets it take a
    core from a training thread for a time slice, and torch's other threads wait for that
    one at the next parallel region. Only for work a training thread waits for without a
    time limit when it needs it (the checkpoint writer at the next save, MLflow's import
    before the first tell: `import_in_idle_time`), so that the waiting itself frees a core
    for it. Threads and processes it starts inherit the policy. Elsewhere, or when not
    allowed, less happens."""
    tid = threading.get_native_id()
    with contextlib.suppress(AttributeError, OSError):
        # NICE above the process's own (a worker started under `nice` stays below it), once
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + NICE)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    if idle:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def import_in_idle_time(name: str) -> None:
    """Import module `name` (if it is not yet) on a thread of its own that runs in idle CPU
    time only (`lower_priority(idle=True)`), and wait for it. For an import that costs
    seconds of CPU beside training: a thread that goes on to start threads of its own (a
    run's sender) stays out of the idle class, which they would inherit."""

    def run() -> None:
        lower_priority(idle=True)
        with contextlib.suppress(ImportError):  # the caller's own import reports it
            importlib.import_module(name)

    thread = threading.Thread(target=run, daemon=True, name=f"import-{name}")
    thread.start()
    thread.join()


def _helper_init(parent_pid: int) -> None:
    """In the helper: lower its priority, ignore Ctrl-C (it reaches the whole
    process group; the worker stops gracefully and ends the helper itself), and end it when
    its parent is gone (a worker killed with SIGKILL closes nothing, and the helper would
    wait forever)."""
    lower_priority()  # this process's only thread so far: its threads inherit it
    # (not SCHED_IDLE: the worker's run endings wait for its jobs, with a time limit, while
    # training goes on)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)  # seconds
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def trial_plots(*args: Any) -> list[Path]:
    """The helper's job for a finished trial: `hpsearch.tracking.artifacts.trial_artifacts`,
    imported in the process that runs it. The worker hands this function over by reference,
    so it never imports matplotlib itself (0.3 s of CPU, on a thread that shares the GIL
    with training); the helper does."""
    from hpsearch.tracking.artifacts import trial_artifacts

    return trial_artifacts(*args)


class Renderer:
    """Runs CPU-heavy artifact jobs (a finished trial's plots) in one helper process.

    On one of the worker's own threads such a job holds the GIL for long stretches, and the
    training loop, which needs the GIL between torch ops, stalls behind it: two epochs of the
    tiny study took 15-16 s instead of 12 s on 2 cores while the previous trial's plots and
    ONNX export ran on a thread (niced or not). (The ONNX export now runs on the worker's
    main thread as it stops: `TrackingSession.hold_for_onnx`.) The helper has its own GIL
    and a lower priority. It is started on the first job (a fresh interpreter: no inherited
    threads or locks) and imports only what its jobs need; like any `spawn` child it imports
    the main module first, which `hpsearch`'s entry points guard. It ends with its parent.
    If it cannot start or dies, the job runs in this process instead: artifacts are best
    effort, never lost for want of a helper.
    """

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._broken = False  # or closed: jobs run in this process from then on
        self._lock = threading.Lock()

    def _get(self) -> ProcessPoolExecutor | None:
        with self._lock:
            if self._pool is None and not self._broken:
                try:
                    self._pool = ProcessPoolExecutor(
                        max_workers=1,
                        mp_context=multiprocessing.get_context("spawn"),
                        initializer=_helper_init,
                        initargs=(os.getpid(),),
                    )
                except (OSError, ValueError) as exc:
                    logger.warning("artifact helper process unavailable: %s", exc)
                    self._broken = True
            return self._pool

    def run(self, fn: Callable[..., T], *args: Any, timeout_s: float = 600.0) -> T:
        """`fn(*args)` in the helper process; its exceptions are raised here. `fn` must be a
        module-level function and the arguments picklable."""
        pool = self._get()
        if pool is not None:
            try:
                future = pool.submit(fn, *args)  # starts the helper on the first job
            except Exception as exc:  # it could not start (OSError, a broken pool, ...)
                self._give_up(pool, exc)
            else:
                try:
                    return future.result(timeout=timeout_s)
                except (BrokenProcessPool, TimeoutError) as exc:
                    self._give_up(pool, exc)
        return fn(*args)

    def _give_up(self, pool: ProcessPoolExecutor, exc: BaseException) -> None:
        logger.warning("artifact helper process failed (%s); working here", exc)
        with self._lock:
            self._broken = True
            self._pool = None
        _stop(pool)

    def close(self) -> None:
        """End the helper; later jobs (a finisher that outlived its close) run here. Every
        job has returned by then (its files are written), so the helper is killed rather
        than left to tear down its interpreter (about 0.4 s on 2 cores, at every exit)."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._broken = True
        if pool is not None:
            _stop(pool)


def _stop(pool: ProcessPoolExecutor, manager_wait_s: float = 10.0) -> None:
    """Shut a pool down without waiting for a stuck job: its process is killed, so the
    pool's manager thread (not a daemon) ends, and it is waited for (at most
    `manager_wait_s`) while it closes its wake-up pipe. Before Python 3.13,
    concurrent.futures' exit hook writes to that pipe unlocked: an exit while the thread was
    still closing it failed with EBADF (a worker's exit code 1, seen in CI)."""
    manager = getattr(pool, "_executor_manager_thread", None)  # None once shut down
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        with contextlib.suppress(OSError, AttributeError):
            proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    if manager is not None and manager is not threading.current_thread():
        manager.join(timeout=manager_wait_s)
