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


def test_a_snapshot_is_abandoned_once_its_process_is_gone(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    from hpsearch.runs import _rmtree, _snapshot, remove_stale_snapshots, snapshot_abandoned

    study = tmp_path / "checkpoints" / "study"
    study.mkdir(parents=True)
    best = study / "trial-00003.best.pt"
    best.write_bytes(b"weights")
    mine = _snapshot(best)  # this process's, alive
    assert mine is not None and mine.read_bytes() == b"weights"
    code = (
        "import sys; from pathlib import Path; from hpsearch.runs import _snapshot; "
        "print(_snapshot(Path(sys.argv[1])).parent)"
    )  # a worker that dies holding its snapshot (no clean-up: the interpreter just ends)
    dead = subprocess.run([sys.executable, "-c", code, str(best)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    left = Path(dead.stdout.strip())
    assert left.parent == study and (left / best.name).read_bytes() == b"weights"
    unknown = study / ".upload-abcd1234"  # an older version's: no owner file
    unknown.mkdir()
    remote = study / ".upload-efgh5678"  # another machine's, on a shared work folder
    remote.mkdir()
    (remote / ".owner").write_text("another-host")  # unlocked here: its lock may be local
    host = socket.gethostname()
    assert snapshot_abandoned(left, host) and not snapshot_abandoned(mine.parent, host)
    assert not snapshot_abandoned(unknown, host) and not snapshot_abandoned(remote, host)

    assert remove_stale_snapshots(tmp_path / "checkpoints") == [left]
    assert not left.exists() and mine.exists() and best.exists()
    assert unknown.exists() and remote.exists()
    assert remove_stale_snapshots(tmp_path / "nothing-here") == []
    _rmtree(mine.parent)  # this process's own: deleted, and its lock released
    assert not mine.parent.exists()


def test_a_worker_may_still_export_a_trial_it_holds_a_model_of_while_it_lives() -> None:
    from hpsearch.runs import may_still_export

    alive = {101}.__contains__
    held = {"checkpoint_uri": "runs:/r/checkpoint/best.pt", "host": "box", "pid": 101}
    assert may_still_export(held, "box", alive)  # stops, then exports
    assert not may_still_export({**held, "pid": 102}, "box", alive)  # gone: it never will
    assert may_still_export({**held, "pid": 102}, "other", alive)  # another host's: unknown
    assert not may_still_export({**held, "checkpoint_uri": None}, "box", alive)  # none held


def test_a_forked_child_does_not_keep_the_parents_snapshots_locked(tmp_path: Path) -> None:
    """A DataLoader worker forked while a snapshot exists: its copy of the lock's descriptor
    is closed, so it cannot keep a dead parent's folder from being swept."""
    from hpsearch.runs import _owner_fds, _rmtree, _snapshot

    best = tmp_path / "trial-00001.best.pt"
    best.write_bytes(b"weights")
    snap = _snapshot(best)
    assert snap is not None and snap.parent in _owner_fds
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it still holds, and leave at once
        os.write(write, str(len(_owner_fds)).encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"0"
    os.waitpid(pid, 0)
    os.close(read)
    assert snap.parent in _owner_fds  # the parent's lock is still held
    _rmtree(snap.parent)
