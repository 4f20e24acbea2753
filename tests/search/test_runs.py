"""The worker's MLflow run finisher: when queued run endings run."""

from __future__ import annotations

import threading
import time

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
