"""Background threads that must not slow training down."""

from __future__ import annotations

import contextlib
import os
import threading

NICE = 10  # added to the thread's nice value: it gets CPU time the training threads leave


def lower_priority() -> None:
    """Call first thing in a background thread (MLflow uploads, plots, checkpoint writes):
    on Linux a thread has its own nice value, so the scheduler gives the training threads'
    cores to it only when they are idle. Elsewhere, or when not allowed, nothing happens."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
