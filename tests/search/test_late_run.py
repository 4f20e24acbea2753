"""worker._LateRun hands the epochs a first trial trained before its MLflow run existed to
the run once it starts, in order, without holding up the training thread: a run's
log_epoch may write to the database (an input-bound flag) and wait for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hpsearch.errors import StorageError
from hpsearch.worker import _LateRun


class SlowRun:
    """A run whose first log_epoch waits, like a database write that takes its time."""

    run_id = "run-0"

    def __init__(self, failing: int | None = None) -> None:
        self.epochs: list[int] = []
        self.replaying = threading.Event()
        self.release = threading.Event()
        self.checkpoints: list[Path] = []
        self.failing = failing

    def log_epoch(self, record: Any, timestamp_ms: int | None = None) -> None:
        if not self.epochs and not self.replaying.is_set():
            self.replaying.set()
            self.release.wait(10)
        if record.epoch == self.failing:
            raise RuntimeError("a metric the tracker cannot take")
        self.epochs.append(record.epoch)

    def checkpoint_written(self, path: Path) -> None:
        self.checkpoints.append(path)

    def finish_failed(self, outcome: str, reason: str, tb: str | None) -> None:
        self.ended = (outcome, reason)


class Session:
    """What _LateRun uses of runs.TrackingSession, with the set-up still going on."""

    def __init__(self, run: SlowRun) -> None:
        self.run = run
        self.jobs: list[Callable[[], None]] = []

    def ready(self) -> bool:
        return False

    def early_gpu_sampler(self) -> None:
        return None

    def when_ready(self, job: Callable[[], None]) -> None:
        self.jobs.append(job)

    def wait_ready(self) -> None:
        pass

    def setup_failed(self) -> BaseException | None:
        return None

    def trial_ending(self) -> None:
        pass

    def start_trial(self, *args: Any, **kwargs: Any) -> SlowRun:
        return self.run

    def note_unreachable(self) -> int:
        self.down_in_a_row = getattr(self, "down_in_a_row", 0) + 1
        return self.down_in_a_row


class Trial:
    number = 0

    def __init__(self) -> None:
        self.user_attrs: dict[str, Any] = {}

    def set_user_attr(self, key: str, value: Any) -> None:
        self.user_attrs[key] = value


class Record:
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch


def test_epochs_from_before_the_start_reach_the_run_in_order_without_blocking_training(
    tmp_path: Path,
) -> None:
    run = SlowRun()
    session = Session(run)
    trial = Trial()
    late = _LateRun(session, trial, {}, 0, tmp_path / "ckpt", lambda fn, what: fn())  # type: ignore[arg-type]
    for epoch in (1, 2):
        late.log_epoch(Record(epoch))
    late.checkpoint_written(tmp_path / "ckpt")
    start = threading.Thread(target=session.jobs[0])  # the set-up thread, once ready
    start.start()
    assert run.replaying.wait(10)  # the start is replaying epoch 1, waiting on the slow write
    t0 = time.perf_counter()
    late.log_epoch(Record(3))  # the training thread's next epoch
    assert time.perf_counter() - t0 < 1.0  # not held up by the replay (up to 10 s)
    run.release.set()
    start.join(10)
    assert not start.is_alive()
    late.log_epoch(Record(4))  # after the start: straight to the run
    assert run.epochs == [1, 2, 3, 4]
    assert late.wait() is run
    assert run.checkpoints == [tmp_path / "ckpt"]
    assert trial.user_attrs == {"mlflow_run_id": "run-0"}  # linked


def test_an_epoch_the_run_refuses_loses_neither_the_others_nor_the_run(tmp_path: Path) -> None:
    run = SlowRun(failing=2)
    run.release.set()
    session = Session(run)
    late = _LateRun(session, Trial(), {}, 0, tmp_path / "ckpt", lambda fn, what: fn())  # type: ignore[arg-type]
    for epoch in (1, 2, 3):
        late.log_epoch(Record(epoch))
    late.checkpoint_written(tmp_path / "ckpt")
    session.jobs[0]()
    assert late.wait() is run  # told, and so ended, with the trial
    assert run.epochs == [1, 3] and run.checkpoints == [tmp_path / "ckpt"]
    late.log_epoch(Record(4))
    assert run.epochs == [1, 3, 4]


class Sampler:
    def __init__(self) -> None:
        self.restarts = 0
        self.pauses = 0

    def pause_rule(self) -> None:
        self.pauses += 1

    def restart_warmup(self) -> None:
        self.restarts += 1

    def stop(self) -> None:
        pass


def test_a_trials_first_epoch_end_starts_its_samplers_rule(tmp_path: Path) -> None:
    """Its sampler runs, paused, from the trial's start: held early (the run not started
    yet) or the run's own, training_began reaches it either way."""
    early = Sampler()
    session = Session(SlowRun())
    session.early_gpu_sampler = lambda: (early, None)  # type: ignore[method-assign,assignment,return-value]
    late = _LateRun(session, Trial(), {}, 0, tmp_path / "ckpt", lambda fn, what: fn())  # type: ignore[arg-type]
    late.training_began()
    assert (early.pauses, early.restarts) == (0, 1)

    run = SlowRun()
    run.release.set()
    run.sampler = Sampler()  # type: ignore[attr-defined]
    session = Session(run)
    late = _LateRun(session, Trial(), {}, 0, tmp_path / "ckpt", lambda fn, what: fn())  # type: ignore[arg-type]
    session.jobs[0]()  # started: the sampler is the run's
    late.training_began()
    assert (run.sampler.pauses, run.sampler.restarts) == (0, 1)  # type: ignore[attr-defined]


def test_a_link_the_outage_kept_from_its_write_is_written_before_the_tell(
    tmp_path: Path,
) -> None:
    """The start's thread gave up writing the run's link (the database down past the
    outage limit) while the trial trained: the tell's wait writes it again, and keeps the
    run; if it fails again, the run is ended and the worker stops (StorageError)."""
    for comes_back in (True, False):
        run = SlowRun()
        run.release.set()
        session = Session(run)
        trial = Trial()
        tries: list[str] = []

        def db(fn: Callable[[], Any], what: str, tries: list[str] = tries,
               comes_back: bool = comes_back) -> Any:  # fmt: skip
            tries.append(what)
            if len(tries) == 1 or not comes_back:
                raise StorageError("the database is down")
            return fn()

        late = _LateRun(session, trial, {}, 0, tmp_path / "ckpt", db)  # type: ignore[arg-type]
        session.jobs[0]()
        late.log_epoch(Record(1))
        if comes_back:
            assert late.wait() is run and trial.user_attrs == {"mlflow_run_id": "run-0"}
            assert run.epochs == [1] and not hasattr(run, "ended")
        else:
            with pytest.raises(StorageError):
                late.wait()
            assert run.ended[0] == "failed" and trial.user_attrs == {}
        assert len(tries) == 2


def _slow_create(
    run: SlowRun, tmp_path: Path
) -> tuple[Trial, _LateRun, threading.Thread, threading.Event, threading.Event]:
    """A trial whose run's create waits until `answered` is set (a slow or hanging server),
    started on its own thread as the session starts it: (trial, late, start thread, the
    worker's stop event, answered)."""
    session = Session(run)
    answered = threading.Event()

    def slow_start(*args: Any, **kwargs: Any) -> SlowRun:
        answered.wait(10)
        return run

    session.start_trial = slow_start  # type: ignore[method-assign]
    stop = threading.Event()
    trial = Trial()
    late = _LateRun(session, trial, {}, 0, tmp_path / "ckpt", lambda fn, what: fn(), None, stop)  # type: ignore[arg-type]
    start = threading.Thread(target=session.jobs[0])
    start.start()
    return trial, late, start, stop, answered


def test_a_trial_that_ends_while_its_create_waits_leaves_no_run_running(
    tmp_path: Path,
) -> None:
    """A worker told to stop does not wait out a create that hangs (minutes on a server
    that does not answer); the run, made after all, is ended at once, not left RUNNING."""
    run = SlowRun()
    trial, late, start, stop, answered = _slow_create(run, tmp_path)
    stop.set()  # Ctrl-C
    t0 = time.perf_counter()
    assert late.wait(after_stop_s=0.5) is None  # the worker's 30 s, shortened
    assert time.perf_counter() - t0 < 3.0
    answered.set()  # the server answers at last
    start.join(10)
    assert run.ended[0] == "interrupted" and trial.user_attrs == {}
    assert late.run is None


def test_a_run_whose_trial_ended_during_its_link_write_is_ended(tmp_path: Path) -> None:
    """The stop came after the create returned, while the link's write (a database that
    is slow to answer) or the epochs' hand-over went on: the run is ended, not RUNNING."""
    run = SlowRun()
    run.release.set()
    session = Session(run)
    writing = threading.Event()
    answer = threading.Event()

    def db(fn: Callable[[], Any], what: str) -> Any:
        writing.set()
        answer.wait(10)
        return fn()

    stop = threading.Event()
    late = _LateRun(session, Trial(), {}, 0, tmp_path / "ckpt", db, None, stop)  # type: ignore[arg-type]
    start = threading.Thread(target=session.jobs[0])
    start.start()
    assert writing.wait(10)
    stop.set()
    assert late.wait(after_stop_s=0.0) is None
    answer.set()
    start.join(10)
    assert run.ended[0] == "interrupted" and late.run is None


def test_a_stopped_trial_waits_a_while_for_a_create_that_answers(tmp_path: Path) -> None:
    """With checkpoint uploads, a trial interrupted by a stop hands its checkpoint to its
    run for another host to resume from: a create that answers a moment after the stop is
    waited for (it was given up at once, and the interrupted trial had no run)."""
    run = SlowRun()
    run.release.set()
    trial, late, start, stop, answered = _slow_create(run, tmp_path)
    stop.set()
    threading.Timer(0.5, answered.set).start()
    assert late.wait() is run and trial.user_attrs == {"mlflow_run_id": "run-0"}
    start.join(10)
    assert not hasattr(run, "ended")


def test_a_stop_cuts_short_the_wait_for_a_set_up_that_hangs(tmp_path: Path) -> None:
    """A worker's first trial's run starts once MLflow's set-up is over; a set-up stuck on
    a server that does not answer held a stopped worker's tell for minutes."""
    session = Session(SlowRun())
    session.wait_ready = lambda: time.sleep(8)  # type: ignore[method-assign]  # joins it
    stop = threading.Event()
    late = _LateRun(session, Trial(), {}, 0, tmp_path / "ckpt", lambda fn, what: fn(), None, stop)  # type: ignore[arg-type]
    stop.set()
    t0 = time.perf_counter()
    assert late.wait(after_stop_s=0.2) is None
    assert time.perf_counter() - t0 < 3.0
    failed = Session(SlowRun())  # a set-up that failed: no run, at once
    failed.setup_failed = lambda: RuntimeError("no server")  # type: ignore[method-assign,assignment,return-value]
    late = _LateRun(failed, Trial(), {}, 0, tmp_path / "ckpt", lambda fn, what: fn())  # type: ignore[arg-type]
    assert late.wait() is None


def test_a_stopping_worker_does_not_wait_for_a_set_up_stuck_on_its_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's close waited for its set-up thread without a limit: a set-up stuck on
    a server that does not answer kept a stopped worker until the launcher killed it."""
    import hpsearch.runs as runs
    from hpsearch.config import load_config
    from hpsearch.storage import StorageSpec

    answered = threading.Event()

    def stuck(uri: str) -> None:
        answered.wait(30)
        raise ConnectionError("the server never answered")  # the set-up ends quietly

    monkeypatch.setattr(runs, "_client", stuck)
    monkeypatch.setattr(runs, "SETUP_WAIT_AFTER_STOP_S", 0.5)
    stop = threading.Event()
    spec = StorageSpec("journal", str(tmp_path / "j"), "journal")
    session = runs.TrackingSession(load_config("tiny"), spec, "http://127.0.0.1:9", "w0",
                                   background=True, stop=stop)  # fmt: skip
    try:
        stop.set()
        t0 = time.perf_counter()
        session.close()
        assert time.perf_counter() - t0 < 5.0
    finally:
        answered.set()


class DownSession(Session):
    """A session whose server does not answer the first `down` starts (the session's own
    set-up went through, or failed quietly): its run starts on a later try."""

    def __init__(self, run: SlowRun, down: int, answers: bool = True) -> None:
        super().__init__(run)
        self.down = down
        self.tries = 0
        self.up = answers
        self.tried = threading.Event()
        self.again: list[bool | None] = []

    def ready(self) -> bool:
        return True

    def when_ready(self, job: Callable[[], None]) -> None:
        threading.Thread(target=job, daemon=True).start()

    def start_trial(self, *args: Any, **kwargs: Any) -> SlowRun:
        from hpsearch.errors import TrackingUnreachable

        if kwargs.get("offline"):  # kept in the spool folder: no run id until it is sent
            self.offline = SlowRun()
            self.offline.release.set()
            self.offline.run_id = None  # type: ignore[assignment]
            return self.offline
        self.tries += 1
        self.again.append(kwargs.get("again"))
        self.tried.set()
        if self.tries <= self.down:
            raise TrackingUnreachable("MLflow at http://127.0.0.1:9 did not answer")
        return self.run

    def answers(self) -> bool:
        return self.up


def test_a_run_mlflow_did_not_answer_is_tried_again_while_the_trial_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server down when the trial started (past the tracker's 15 s) left it without a run
    for good, and its epochs were dropped: the start is tried again, and every epoch
    reaches the run once it starts, in order, and the run is linked."""
    import hpsearch.worker as worker

    monkeypatch.setattr(worker, "RUN_START_RETRY_S", (0.05, 0.1))
    run = SlowRun()
    run.release.set()
    session = DownSession(run, down=2)
    trial = Trial()
    late = _LateRun(session, trial, {}, 0, tmp_path / "ckpt", lambda fn, what: fn())  # type: ignore[arg-type]
    late.log_epoch(Record(1))
    deadline = time.monotonic() + 10
    while late.started_run() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late.started_run() is run and session.tries == 3
    assert session.again == [False, True, True]  # a later try looks for a create that landed
    late.log_epoch(Record(2))
    assert late.wait() is run
    assert run.epochs == [1, 2] and trial.user_attrs == {"mlflow_run_id": "run-0"}


def test_a_trial_that_ends_before_mlflow_answers_tries_once_more_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next try is minutes away when the trial ends: the end tries at once if the
    server answers by then (its epochs reach the run), and else keeps the run whole in
    the spool folder (made when the server answers), not held for the next try."""
    import hpsearch.worker as worker

    monkeypatch.setattr(worker, "RUN_START_RETRY_S", (300.0,))
    for up in (True, False):
        run = SlowRun()
        run.release.set()
        session = DownSession(run, down=1, answers=up)
        early = Sampler()
        stopped: list[bool] = []
        early.stop = lambda stopped=stopped: stopped.append(True)  # type: ignore[method-assign]
        session.early_gpu_sampler = lambda early=early: (early, None)  # type: ignore[method-assign,assignment,return-value]
        trial = Trial()
        late = _LateRun(session, trial, {}, 0, tmp_path / "ckpt", lambda fn, what: fn())  # type: ignore[arg-type]
        assert session.tried.wait(10)
        for epoch in (1, 2):
            late.log_epoch(Record(epoch))
        t0 = time.perf_counter()
        got = late.wait()
        assert time.perf_counter() - t0 < 3.0
        if up:
            assert got is run and session.tries == 2
            assert run.epochs == [1, 2] and trial.user_attrs == {"mlflow_run_id": "run-0"}
            assert not stopped  # the run took the trial's sampler
        else:
            assert got is session.offline and session.tries == 1
            assert got.epochs == [1, 2] and trial.user_attrs == {}  # not linked
            assert not stopped  # the kept run took the trial's sampler


def test_a_server_that_refuses_is_not_tried_again(tmp_path: Path) -> None:
    """A login or a permission the server refuses (403) is no outage: the trial's run is
    not tried again every few minutes, each try with its warnings."""
    import hpsearch.runs as runs
    from hpsearch.config import load_config
    from hpsearch.storage import StorageSpec
    from stack_util import fake_mlflow

    with fake_mlflow(403) as uri:
        spec = StorageSpec("journal", str(tmp_path / "j"), "journal")
        session = runs.TrackingSession(load_config("tiny"), spec, uri, "w0")
        try:
            assert session._connect() is None  # refused, not unreachable
            assert session.start_trial(Trial(), {}, 0, tmp_path / "ckpt") is None  # type: ignore[arg-type]
        finally:
            session.close()
    # A proxy while MLflow behind it is down (a 503, or its default page's 404): a later
    # try may do; its /health's 503 is no answer, a 404 (no /health there) is one.
    for status, answers in ((503, False), (404, True)):
        with fake_mlflow(status, health_status=status) as uri:
            session = runs.TrackingSession(load_config("tiny"), spec, uri, "w0")
            try:
                assert session._connect() is False and session.answers() is answers
            finally:
                session.close()


def test_a_trial_ending_cuts_short_the_wait_for_the_study_run_on_a_server_that_is_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA: a launch's worker waits up to 240 s for the launch's study run (the embedded
    server may still be starting); with the server down, its first trial, trained, sat
    untold that long. Its end now cuts the wait short (its run kept for later), and no
    second study run is opened while the launch's may still come."""
    import http.server

    import hpsearch.runs as runs
    import hpsearch.tracking.mlflow_logger as ml
    from hpsearch.config import load_config
    from hpsearch.storage import StorageSpec
    from hpsearch.tracking.server import free_port

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # /health answers; the API has no study run for it
            ok = self.path == "/health"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(b"OK" if ok else b"")

        def log_message(self, *args: Any) -> None:
            pass

    spec = StorageSpec("journal", str(tmp_path / "j"), "journal")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_port}"
    session = runs.TrackingSession(load_config("tiny"), spec, uri, "w0",
                                   await_study_run_s=120, background=True)  # fmt: skip
    try:
        time.sleep(2.0)
        session.trial_ending()  # the server answers: the launch's study run is waited for
        time.sleep(1.0)
        assert not session.ready()
        server.shutdown()
        server.server_close()  # down since it answered: the ended trial waits no longer
        t0 = time.monotonic()
        session.wait_ready()
        assert time.monotonic() - t0 < 30 and session.parent_run_id is None
        # The server answers now, without the launch's study run yet: not opened here.
        monkeypatch.setattr(ml, "ensure_experiment", lambda client, name: "1")
        monkeypatch.setattr(ml, "find_study_runs", lambda client, exp, uid=None: [])

        def second(*a: Any) -> str:
            raise AssertionError("a second study run")

        monkeypatch.setattr(runs, "open_study_run", second)
        assert session._connect() is False
        monkeypatch.setattr(ml, "find_study_runs", lambda client, exp, uid=None: ["launchs"])
        assert session._connect() is True and session.parent_run_id == "launchs"
    finally:
        session.close()


def test_a_server_the_launch_saw_answer_is_not_waited_for_as_one_starting(
    tmp_path: Path,
) -> None:
    """QA: an MLflow server that died in a launch's first seconds, after the launch's own
    check and before the worker's first look (taken in idle CPU time), was waited for as
    an embedded server still starting: finished trials sat untold 240 s. The launch now
    says it answered (`--server-answered`); one still starting is waited for."""
    import hpsearch.runs as runs
    from hpsearch.config import load_config
    from hpsearch.storage import StorageSpec
    from hpsearch.tracking.server import free_port

    spec = StorageSpec("journal", str(tmp_path / "j"), "journal")
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens: down from the first look
    told = runs.TrackingSession(load_config("tiny"), spec, uri, "w0", await_study_run_s=120,
                                server_answered=True, background=True)  # fmt: skip
    # Its wait is short: closing it waits it out (120 s took 2 minutes of the suite).
    starting = runs.TrackingSession(load_config("tiny"), spec, uri, "w1", await_study_run_s=8,
                                    background=True)  # fmt: skip
    try:
        told.trial_ending()
        starting.trial_ending()
        t0 = time.monotonic()
        told.wait_ready()
        assert time.monotonic() - t0 < 30 and told.parent_run_id is None
        time.sleep(3.0)
        assert not starting.ready()  # an embedded server may take minutes to start
    finally:
        told.close()
        starting.close()
