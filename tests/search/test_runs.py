"""The worker's MLflow run finisher: when queued run endings run; the snapshots of best
models that killed workers leave behind."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from hpsearch.runs import _Finisher


def test_a_finished_runs_ending_waits_for_the_next_trial_to_train() -> None:
    done = threading.Event()
    f = _Finisher(hold_s=30)
    try:
        f.submit(done.set)
        assert not done.wait(0.5)  # the next trial's ask and start-up go first
        f.release()
        assert done.wait(5)
    finally:
        f.close()


def test_close_runs_every_queued_ending_and_a_hold_has_a_limit() -> None:
    ran: list[int] = []
    f = _Finisher(hold_s=30)
    for i in range(3):
        f.submit(lambda i=i: ran.append(i))
    f.close()  # a stopping worker: nothing dropped, no 30 s wait
    assert ran == [0, 1, 2]

    done = threading.Event()
    g = _Finisher(hold_s=0.3)  # no next trial (e.g. waiting for GPU memory): not forever
    t0 = time.monotonic()
    g.submit(done.set)
    assert done.wait(5)
    assert time.monotonic() - t0 >= 0.25
    g.close()


def test_stale_snapshots_are_this_hosts_folders_of_dead_processes() -> None:
    from hpsearch.runs import stale_snapshots

    names = [
        ".upload-101@gpu-box-1@k2j4_x9a",  # dead, here
        ".upload-102@gpu-box-1@aaaa1111",  # alive, here
        ".upload-101@gpu-box-2@bbbb2222",  # another host's (a shared work folder)
        ".upload-abcd1234",  # the old unnamed shape: whose is unknown
        "trial-00001.best.pt",
    ]
    alive = {102}.__contains__
    assert stale_snapshots(names, "gpu-box-1", alive) == [".upload-101@gpu-box-1@k2j4_x9a"]
    assert stale_snapshots(names, "gpu-box-2", alive) == [".upload-101@gpu-box-2@bbbb2222"]


def test_a_killed_workers_snapshots_are_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    from hpsearch.runs import _snapshot, remove_stale_snapshots

    best = tmp_path / "checkpoints" / "study" / "trial-00003.best.pt"
    best.parent.mkdir(parents=True)
    best.write_bytes(b"weights")
    mine = _snapshot(best)  # this process's: alive
    assert mine is not None and mine.read_bytes() == b"weights"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    left = best.parent / f".upload-{int(dead.stdout)}@{socket.gethostname()}@x1y2z3w4"
    left.mkdir()
    os.link(best, left / best.name)
    assert remove_stale_snapshots(tmp_path / "checkpoints") == [left]
    assert not left.exists() and mine.exists() and best.exists()
    assert remove_stale_snapshots(tmp_path / "nothing-here") == []
