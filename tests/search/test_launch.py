"""`hpsearch launch` / `worker` / `status` / `best` / `studies` end to end, as subprocesses,
on the real PostgreSQL (and the embedded journal default)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import hpsearch as hps
import pytest
from cli_util import DUMMY, group_alive, hpsearch, popen
from disk_util import tmpfs
from optuna.trial import TrialState
from pg_util import terminate_backends, url_up_later


def finished(study) -> list:  # type: ignore[no-untyped-def]
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))


def test_launch_three_workers_real_flowers_on_postgres(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str], flowers_root: Path
) -> None:
    r = hpsearch(
        [
            "launch",
            "--study",
            "tiny",
            "--workers",
            "3",
            "--trials",
            "3",
            "--storage",
            pg_url,
            "--workdir",
            str(tmp_path / "w"),
            "--no-tracking",
            "--device",
            "cpu",
            "--data-dir",
            str(flowers_root),
            "--set",
            "budget.max_epochs=1",
        ],
        subprocess_env,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    study = hps.load_study("tiny", storage=pg_url)
    trials = study.get_trials(deepcopy=False)
    assert len(finished(study)) == 3
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert len({t.user_attrs["pid"] for t in trials}) == 3, "trials must come from 3 processes"
    for t in finished(study):
        assert t.user_attrs["outcome"] in ("finished", "pruned")
        assert len(t.user_attrs["history"]) == 1
    assert "done (budget): complete" in r.stdout


def test_relaunch_resumes_and_independent_worker_joins(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    work = str(tmp_path / "w")
    common = [
        "--study",
        "tiny",
        "--storage",
        pg_url,
        "--workdir",
        work,
        "--no-tracking",
        "--train-fn",
        DUMMY,
        "--set",
        "budget.max_epochs=3",
    ]
    r = hpsearch(["launch", *common, "--workers", "2", "--trials", "4"], subprocess_env)
    assert r.returncode == 0, r.stdout + r.stderr
    study = hps.load_study("tiny", storage=pg_url)
    first = {t.number: t.params for t in study.get_trials()}
    assert sorted(first) == [0, 1, 2, 3]

    # Relaunch with a larger budget; a separately started worker joins while it runs.
    env = {**subprocess_env, "HPSEARCH_DUMMY_EPOCH_S": "1.0"}
    launch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpsearch.cli",
            "launch",
            *common,
            "--workers",
            "2",
            "--trials",
            "12",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # The joiner obeys the budget the launch records on the study; start it once it is there
    # (before that, the old budget of 4 is spent and a worker rightly exits at once).
    deadline = time.monotonic() + 120
    while hps.load_study("tiny", storage=pg_url).user_attrs.get("hpsearch.n_trials") != 12:
        assert time.monotonic() < deadline, "launch never recorded the new budget"
        time.sleep(0.2)
    joiner = popen(["worker", *common, "--worker-id", "joiner"], env, tmp_path / "joiner.log")
    try:
        out, _ = launch.communicate(timeout=300)
        assert launch.returncode == 0, out
        assert joiner.wait(timeout=120) == 0, (tmp_path / "joiner.log").read_text()
    finally:
        launch.kill()
        joiner.kill()
    study = hps.load_study("tiny", storage=pg_url)
    trials = study.get_trials()
    assert sorted(t.number for t in trials) == list(range(12)), "no duplicate or lost numbers"
    assert len(finished(study)) == 12
    for n, params in first.items():
        assert trials[n].params == params, "earlier trials are kept, not redone"
    workers = {t.user_attrs["worker"] for t in trials[4:]}
    assert "joiner" in workers and len(workers) == 3, workers

    # status, best (text and JSON), studies and the Python API agree on the best trial.
    api = hps.best_trials("tiny", storage=pg_url, k=3)
    best_n, best_v = int(api.iloc[0]["number"]), float(api.iloc[0]["value"])
    assert best_v == study.best_value and best_n == study.best_trial.number
    assert list(api["value"]) == sorted(api["value"], reverse=True)
    js = json.loads(
        hpsearch(
            ["best", "--study", "tiny", "--storage", pg_url, "-k", "3", "--json"], subprocess_env
        ).stdout
    )
    assert js[0]["number"] == best_n and js[0]["value"] == best_v and len(js) == len(api)
    text = hpsearch(["best", "--study", "tiny", "--storage", pg_url], subprocess_env).stdout
    assert text.splitlines()[0].startswith(f"trial {best_n}: value {best_v:.6g}")
    st = hpsearch(["status", "--study", "tiny", "--storage", pg_url], subprocess_env).stdout
    assert "complete" in st and f"best: trial {best_n} value {best_v:.6g}" in st
    assert hps.study_status("tiny", storage=pg_url).counts["running"] == 0
    # every trial records its start-up (ask to first training step); status reports it
    assert all(t.user_attrs["startup_s"] > 0 for t in finished(study))
    assert "per-trial start-up (ask to first step): median" in st
    ls = json.loads(hpsearch(["studies", "--storage", pg_url, "--json"], subprocess_env).stdout)
    assert ls == [
        {
            "name": "tiny",
            "n_trials": 12,
            "counts": {  # every state, as `status --json` gives them
                state.name.lower(): sum(1 for t in study.get_trials() if t.state == state)
                for state in TrialState
            },
            "directions": ["maximize"],
            "best_value": best_v,
            "best_trial": best_n,
            "pareto_size": None,
        }
    ]
    # A worker given the budget with --set, as --trials gives it, records it and runs to it
    # (it was read and ignored: the recorded 12 were spent, and the worker ran nothing).
    more = hpsearch(["worker", *common, "--set", "budget.n_trials=13"], subprocess_env)
    assert more.returncode == 0, more.stdout + more.stderr
    study = hps.load_study("tiny", storage=pg_url)
    assert len(finished(study)) == 13 and study.user_attrs["hpsearch.n_trials"] == 13
    # Without --no-tracking, in a work folder where no MLflow server runs: said, not silent
    tracked = [c for c in common if c != "--no-tracking"]
    idle = hpsearch(["worker", *tracked, "--set", "budget.n_trials=13"], subprocess_env)
    assert idle.returncode == 0, idle.stdout + idle.stderr
    assert "note: no MLflow server runs for" in idle.stderr and "not tracked" in idle.stderr


def test_embedded_default_several_workers(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """No --storage, no tracking URI: the journal file and launch's own MLflow server; in a
    work folder whose path has a space, which the closing hint quotes (QA)."""
    work = tmp_path / "my w"
    r = hpsearch(
        [
            "launch",
            "--study",
            "tiny",
            "--workers",
            "3",
            "--trials",
            "6",
            "--workdir",
            str(work),
            "--train-fn",
            DUMMY,
            "--set",
            "budget.max_epochs=2",
        ],
        # Each worker's first trial waits for the other two: one fast starter could run
        # all six 20 ms trials before the others got there. A worker's later trials score 0,
        # so the median pruner prunes them against the finished first ones: whether a
        # sampled trial fell below the median depended on the order the workers finished.
        {
            **subprocess_env,
            "HPSEARCH_DUMMY_BARRIER": f"{tmp_path / 'barrier'}:3",
            "HPSEARCH_DUMMY_POOR_AFTER_FIRST": "1",
        },
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (work / "optuna.journal").exists()
    study = hps.load_study("tiny", workdir=work)
    assert len(finished(study)) == 6
    assert len({t.user_attrs["pid"] for t in study.get_trials()}) == 3
    assert "MLflow UI: http://127.0.0.1:" in r.stdout
    assert f"(hpsearch ui --workdir '{work}')" in r.stdout, r.stdout
    assert (work / "mlflow" / "mlflow.db").exists()

    # Plots for the trials that trained to their end; a pruned trial has its metrics only.
    from hpsearch.tracking.server import start_local_server
    from mlflow.tracking import MlflowClient

    states = {t.user_attrs["mlflow_run_id"]: t.state.name for t in study.get_trials()}
    assert {"COMPLETE", "PRUNED"} <= set(states.values()), states
    with start_local_server(work) as server:
        client = MlflowClient(server.url)
        for run_id, state in states.items():
            files = {a.path for a in client.list_artifacts(run_id)}
            assert ("learning_curve.png" in files) == (state == "COMPLETE"), (state, files)
            assert client.get_metric_history(run_id, "val_acc"), state


def test_launch_timeout_counts_worker_start_up(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """--timeout is a deadline for the whole launch: no trial starts after it, however long
    the workers took to import and connect; running trials finish and are kept."""
    work = tmp_path / "w"
    # Unbuffered, so the first line is read when it is printed.
    env = dict(subprocess_env, HPSEARCH_DUMMY_EPOCH_S="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpsearch.cli", "launch", "--study", "tiny", "--workers", "2",
         "--trials", "50", "--timeout", "15", "--workdir", str(work), "--train-fn", DUMMY,
         "--no-tracking", "--set", "budget.max_epochs=2", "--set", "pruner={name: none}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    first_line_at, lines = None, []
    for line in proc.stdout:  # the clock starts before the first line is printed
        first_line_at = first_line_at or time.time()
        lines.append(line)
    assert proc.wait(60) == 0, "".join(lines)
    assert first_line_at is not None
    assert "done (timeout)" in "".join(lines)  # was "done (budget)", 48 trials short of it
    study = hps.load_study("tiny", workdir=work)
    trials = study.get_trials(deepcopy=False)
    assert 1 <= len(trials) < 50
    assert all(t.state == TrialState.COMPLETE for t in trials)
    starts = [t.datetime_start.timestamp() for t in trials if t.datetime_start]
    # Workers take seconds to start: a deadline counted from their start would let trials
    # begin seconds after this.
    assert max(starts) <= first_line_at + 15 + 0.5, [s - first_line_at for s in starts]


def test_launch_outcome() -> None:
    from hpsearch.launcher import launch_outcome

    assert launch_outcome("interrupted", True, False) == "budget"  # Ctrl-C after the last tell
    assert launch_outcome("budget", True, True) == "budget"
    assert launch_outcome("interrupted", False, False) == "interrupted"
    assert launch_outcome("workers_failed", False, True) == "workers_failed"
    assert launch_outcome("budget", False, True) == "timeout"
    assert launch_outcome("budget", False, False) == "stopped"  # workers stopped from outside


@pytest.mark.parametrize("restarts", [3, 0])
def test_a_worker_stopped_from_outside_is_restarted_and_its_trial_resumed(
    tmp_path: Path, subprocess_env: dict[str, str], restarts: int
) -> None:
    """A worker stopped by a SIGTERM of its own (a user, a container runtime) hands its
    trial back and exits 143: the launch restarts it, and the trial resumes. It exited 0, and
    the launch ended "done (budget)" with exit 0 and trials of the budget never trained.
    With no restarts left, the launch ends "stopped" (not "every worker crashed"), exit 1."""
    work = tmp_path / "w"
    env = dict(subprocess_env, HPSEARCH_DUMMY_EPOCH_S="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpsearch.cli", "launch", "--study", "tiny", "--workers", "1",
         "--trials", "3", "--workdir", str(work), "--train-fn", DUMMY, "--no-tracking",
         "--max-restarts", str(restarts),
         "--set", "budget.max_epochs=6", "--set", "pruner={name: none}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not _running_with_an_epoch(work):  # mid-trial: it has a trial to hand back
            assert time.monotonic() < deadline and proc.poll() is None, "no trial trained"
            time.sleep(0.1)
        for pid in _child_pids(proc.pid):
            os.kill(pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "worker 0 was stopped (exit code 143)" in out, out
    trials = hps.load_study("tiny", workdir=work).get_trials(deepcopy=False)
    stopped = [t for t in trials if t.state == TrialState.FAIL]
    assert [t.user_attrs.get("outcome") for t in stopped] == ["interrupted"], out
    (resumed,) = [t for t in trials if t.system_attrs.get("failed_trial") == stopped[0].number]
    if restarts:
        assert proc.returncode == 0 and "done (budget): complete 3" in out, out
        assert "restarting it (1/3)" in out and resumed.state == TrialState.COMPLETE, out
    else:
        assert proc.returncode == 1 and "done (stopped)" in out, out
        assert "launch again to resume" in out and resumed.state == TrialState.WAITING, out


def _running_with_an_epoch(work: Path) -> bool:
    try:
        study = hps.load_study("tiny", workdir=work)
    except hps.HpsearchError:  # not made yet
        return False
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    return any(t.intermediate_values for t in running)


@pytest.mark.parametrize("nohup", [False, True])
def test_a_closed_terminal_stops_the_launch_as_ctrl_c_does(
    tmp_path: Path, subprocess_env: dict[str, str], nohup: bool
) -> None:
    """SIGHUP (its terminal or SSH session closed) ended the launcher at once: no "done"
    line, the study's MLflow run left RUNNING and the embedded MLflow server running on
    its own. It is now a stop like Ctrl-C's: trials handed back, the server stopped, exit
    129, its terminal's output dropped (the writes would fail); the second SIGHUP a closing
    shell's terminal sends is the same stop, not a second Ctrl-C's kill. Under nohup
    (SIGHUP ignored) the launch goes on to its end."""
    import pty

    work = tmp_path / "w"
    env = dict(subprocess_env, HPSEARCH_DUMMY_EPOCH_S="0.5")
    main, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpsearch.cli", "launch", "--study", "tiny", "--workers", "1",
         "--trials", "2", "--workdir", str(work), "--train-fn", DUMMY,
         "--set", "budget.max_epochs=8", "--set", "pruner={name: none}"],
        env=env, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
        preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if nohup else None,
    )  # fmt: skip
    os.close(terminal)
    said = bytearray()
    try:
        deadline = time.monotonic() + 180
        while not _running_with_an_epoch(work):
            assert time.monotonic() < deadline and proc.poll() is None, said.decode()
            with contextlib.suppress(OSError):
                said += os.read(main, 65536) if select.select([main], [], [], 0.2)[0] else b""
        server = json.loads((work / "mlflow" / "server.json").read_text())
        proc.send_signal(signal.SIGHUP)
        if not nohup:
            os.close(main)  # the terminal is gone: writing to it fails from here on
            time.sleep(0.5)
            proc.send_signal(signal.SIGHUP)  # the terminal's own, after its shell's: one stop
        while nohup and proc.poll() is None:  # nohup sends the output elsewhere: read it
            assert time.monotonic() < deadline, said.decode()
            with contextlib.suppress(OSError):
                said += os.read(main, 65536) if select.select([main], [], [], 0.2)[0] else b""
        code = proc.wait(timeout=240)
    finally:
        proc.kill()
        if nohup:
            os.close(main)
    left_running = group_alive(int(server["pgid"]))
    if left_running:  # a failed run leaves no server behind for the rest of the suite
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(server["pgid"]), signal.SIGKILL)
    trials = hps.load_study("tiny", workdir=work).get_trials(deepcopy=False)
    log = (work / "logs" / "tiny-worker-0.log").read_text()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert not left_running, "the embedded MLflow server was left running"
    if nohup:
        assert code == 0
        assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    else:
        assert code == 129  # a stop by SIGHUP, as a worker's (QA: 130 said Ctrl-C's)
        assert [t.state for t in trials].count(TrialState.WAITING) == 1  # queued to resume
        assert "trial 0: interrupted" in log, log  # handed back, not killed by a second stop


def test_a_launch_removes_the_temp_files_a_killed_writer_left(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    from hpsearch.worker import STALE_TEMP_S

    folder = tmp_path / "w" / "checkpoints" / "tiny"
    folder.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    left = folder / f".trial-00000-cc4d9528.best.pt.{int(gone.stdout)}.tmp"
    left.write_bytes(b"\0" * 1024)
    old = time.time() - STALE_TEMP_S - 60
    os.utime(left, (old, old))
    r = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "1",
                  "--workdir", str(tmp_path / "w"), "--train-fn", DUMMY, "--no-tracking",
                  "--set", "budget.max_epochs=1"], subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert not left.exists()
    log = (tmp_path / "w" / "logs" / "tiny-worker-0.log").read_text()
    assert f"removed {left} (0.0 MiB): a killed writer's" in log, log


def _child_pids(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_bad_inputs_one_line_nonzero_nothing_written(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    work = tmp_path / "w"
    cases = [
        (["launch", "--study", "tiny", "--workers", "0"], "Invalid value for '--workers'"),
        (
            ["launch", "--study", "tiny", "--device", "cuda", "--no-tracking"],
            "CUDA is not available",
        ),
        (["launch", "--study", "tiny", "--gpus", "7", "--no-tracking"], "--gpus: '7': no such GPU"),
        (["launch", "--study", "tiny", "--storage", "mysql://u:pw@h/db"], "unsupported scheme"),
        (
            [
                "launch",
                "--study",
                "tiny",
                "--storage",
                "postgresql://postgres@127.0.0.1:1/x",
                "--no-tracking",
            ],
            "cannot connect",
        ),
        (
            [
                "launch",
                "--study",
                "tiny",
                "--storage",
                pg_url.rsplit("/", 1)[0] + "/nosuchdb",
                "--no-tracking",
            ],
            'database "nosuchdb" does not exist',
        ),
        (
            ["launch", "--study", "tiny", "--set", "budget.max_epochs=-1", "--storage", pg_url],
            "budget.max_epochs: -1: Input should be greater than or equal to 1",
        ),
        (["launch", "--study", "nosuch"], "no such study file"),
        (
            [
                "launch",
                "--study",
                "tiny",
                "--storage",
                pg_url,
                "--no-tracking",
                "--data-dir",
                "/nonexistent",
            ],
            "dataset flowers102: /nonexistent/flowers-102 not found or incomplete; expected <root>/flowers-102/",
        ),
        (
            [
                "worker",
                "--study",
                "tiny",
                "--storage",
                pg_url,
                "--no-tracking",
                "--data-dir",
                str(tmp_path),
            ],
            "not found or incomplete",
        ),
        (["status", "--study", "ghost", "--storage", pg_url], "study 'ghost' not found"),
        (
            ["train", "--study", "tiny", "--params", "{bad json"],
            "--params: '{bad json': not valid JSON",
        ),
        # QA: a raw "Expected more than 1 value per channel" from torch after the set-up.
        (
            ["train", "--study", "tiny", "--params", '{"batch_size": 1}', "--no-tracking"],
            "--params: batch_size: 1: must be >= 2: batch norm cannot train on batches of one",
        ),
        # It loaded the study named by --trial first: "study 'tiny' not found".
        (
            ["train", "--study", "tiny", "--params", "{}", "--trial", "3"],
            "--params and --trial: give one of them, not both",
        ),
        # click's FloatRange lets nan through, which no deadline is ever past.
        (["launch", "--study", "tiny", "--timeout", "nan"], "'nan': must be a finite number"),
        (["launch", "--study", "tiny", "--grace", "nan"], "'nan': must be a finite number"),
        # Every trial failed on it as it built its model, in every worker.
        (
            [
                "launch",
                "--study",
                "tiny",
                "--set",
                "model.weights=/nonexistent/w.pt",
                "--storage",
                pg_url,
                "--no-tracking",
            ],
            "model.weights: '/nonexistent/w.pt': no such file",
        ),
        # Contradictory options: one of them was ignored without a word.
        (
            ["launch", "--study", "tiny", "--no-tracking", "--tracking-uri", "http://h:1"],
            "--no-tracking and --tracking-uri: give one of them",
        ),
        (
            ["launch", "--study", "tiny", "--max-per-gpu", "2", "--no-tracking"],
            "--max-per-gpu 2: only with --workers auto",
        ),
        # MLflow takes a URI without a scheme for a folder: the worker trained untracked.
        (
            [
                "worker",
                "--study",
                "tiny",
                "--storage",
                pg_url,
                "--train-fn",
                DUMMY,
                "--tracking-uri",
                "127.0.0.1:5000",
            ],
            "--tracking-uri '127.0.0.1:5000': no scheme; give http://127.0.0.1:5000",
        ),
        # A raw '@' in the password: the host was read from after the first one, and the
        # error showed the rest of the password as the host's name.
        (
            ["studies", "--storage", "postgresql://postgres:p@ss-word@127.0.0.1/test"],
            "raw '@'",
        ),
        # A mistyped path read as an empty store: "no studies".
        (["studies", "--storage", "sqlite:////nonexistent/dir/x.db"], "x.db: no such file"),
        # An unset variable (--storage "$DB"): the journal in --workdir was read instead.
        (["studies", "--storage", ""], "--storage': empty; give a URL"),
        # One of the two was ignored without a word (--trials won).
        (
            ["launch", "--study", "tiny", "--trials", "3", "--set", "budget.n_trials=5"],
            "--trials 3 and --set budget.n_trials: n_trials=5 disagree; give one of them",
        ),
        (
            ["launch", "--study", "tiny", "--trials", "3", "--set", "budget={n_trials: 5}"],
            "--trials 3 and --set budget: n_trials=5 disagree",
        ),
        (["studies", "--storage", str(tmp_path / "typo.journal")], "typo.journal: no such file"),
        # A prefix of postgresql passed, for SQLAlchemy's "Can't load plugin" (QA).
        (["studies", "--storage", "postgresq://u@h/db"], "unsupported scheme 'postgresq'"),
        (["studies", "--storage", "sqlite://"], "an in-memory SQLite database is one process's"),
        (["launch", "--study", "/dev/null"], "/dev/null: not a regular file"),  # not "not found"
        (["worker", "--study", "tiny", "--worker-id", "a\nb"], "only printable characters"),
        (
            ["launch", "--study", "tiny", "--storage", "sqlite:////nonexistent/dir/x.db"],
            "cannot connect: folder /nonexistent/dir does not exist",
        ),
    ]
    for args, expected in cases:
        r = hpsearch(
            [*args, "--workdir", str(work)] if args[0] != "status" else args, subprocess_env
        )
        assert r.returncode != 0, args
        err = r.stderr.strip()
        assert expected in err, (args, err)
        assert len(err.splitlines()) == 1, err
        assert "Traceback" not in err and "ss-word" not in err
    assert (
        hpsearch(["studies", "--storage", pg_url, "--json"], subprocess_env).stdout.strip() == "[]"
    )
    assert not (work / "optuna.journal").exists()
    # A refused study file leaves no work folder behind (it was made first).
    fresh = tmp_path / "fresh"
    # ... nor does a refused option, device, storage, tracking URI or params (QA).
    for args in (
        ["launch", "--study", "nosuch"],
        ["worker", "--study", "tiny", "--set", "budget.max_epochs=0"],
        ["train", "--study", "nosuch"],
        ["launch", "--study", "tiny", "--gpus", "0"],
        ["launch", "--study", "tiny", "--device", "cuda"],
        ["worker", "--study", "tiny", "--device", "cuda"],
        ["launch", "--study", "tiny", "--tracking-uri", "htp://x"],
        ["launch", "--study", "tiny", "--storage", pg_url + "_nosuch_db"],
        ["train", "--study", "tiny", "--params", '{"lr": 0.1, "lr": 0.2}'],
        ["train", "--study", "tiny", "--params", '{"batch_size": 0}'],
        ["launch", "--study", "tiny", "--storage", "sqlite:////nonexistent/dir/x.db"],
    ):
        r = hpsearch([*args, "--workdir", str(fresh), "--train-fn", DUMMY]
                     if args[0] != "train" else [*args, "--workdir", str(fresh)],
                     subprocess_env)  # fmt: skip
        assert r.returncode != 0 and not fresh.exists(), (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)  # no note first
    # Empty values: an unset variable (--workdir "$W") put the work folder's files in the
    # current folder, an empty --host listened on every interface (QA).
    for args, option in (
        (["launch", "--study", "tiny", "--workdir", ""], "--workdir"),
        (["launch", "--study", "tiny", "--data-dir", ""], "--data-dir"),
        (["launch", "--study", "tiny", "--tracking-uri", ""], "--tracking-uri"),
        (["ui", "--host", ""], "--host"),
        (["dashboard", "--host", ""], "--host"),
    ):
        r = hpsearch(args, subprocess_env, cwd=tmp_path)
        assert r.returncode == 2 and f"Invalid value for '{option}': empty; give" in r.stderr
    assert not (tmp_path / "optuna.journal").exists()


def test_unreachable_tracking_server_stops_the_launch_before_any_trial(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """An explicit tracking server that cannot be reached ends the launch with one line
    before any worker starts (workers train before the study run exists)."""
    work = tmp_path / "w"
    r = hpsearch(
        ["launch", "--study", "tiny", "--workers", "2", "--workdir", str(work), "--train-fn",
         DUMMY, "--tracking-uri", "http://127.0.0.1:9", "--set", "budget.max_epochs=1"],
        subprocess_env,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == "Error: MLflow: no server answers at http://127.0.0.1:9", r.stderr
    assert "Traceback" not in r.stderr
    assert not (work / "optuna.journal").exists()  # no study, no trial, no worker started
    assert not (work / "logs").exists()
    # A URI MLflow itself refuses (a bare word is a file store, which MLflow 3 refuses):
    # the same one line and exit code, not a traceback and a launch that "succeeds".
    r = hpsearch(
        ["launch", "--study", "tiny", "--workdir", str(work), "--train-fn", DUMMY,
         "--tracking-uri", "notauri", "--set", "budget.max_epochs=1"],
        subprocess_env,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == (
        "Error: tracking URI 'notauri': a folder, which MLflow 3 keeps no new runs in; give "
        "a server's http://HOST:PORT"
    ), r.stderr
    assert "Traceback" not in r.stderr and "running" not in r.stdout  # before any worker
    # A scheme MLflow does not know (QA: a launch made its study first, then failed; a
    # worker trained its trials untracked and exited 0), and a folder for a worker.
    for command, uri, said in (
        ("launch", "htp://foo:5000", "MLflow keeps no runs under htp://"),
        ("worker", "htp://foo:5000", "MLflow keeps no runs under htp://"),
        ("worker", str(tmp_path), "a folder, which MLflow 3 keeps no new runs in"),
    ):
        r = hpsearch([command, "--study", "tiny", "--workdir", str(work), "--train-fn", DUMMY,
                      "--tracking-uri", uri, "--set", "budget.max_epochs=1"],
                     subprocess_env)  # fmt: skip
        assert r.returncode == 1, (command, r.stdout + r.stderr)
        assert r.stderr.strip() == f"Error: tracking URI {uri!r}: {said}; give a server's " + (
            "http://HOST:PORT"
        ), r.stderr
        assert not (work / "optuna.journal").exists(), command  # no study made
    assert not (work / "logs").exists()


def test_a_server_refusing_the_api_stops_the_launch_before_any_trial(
    tmp_path: Path, subprocess_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow 3 answers /health without checking the Host header or the login: a server
    that refuses every API call (403: a host its --allowed-hosts does not list; 401: no
    login) passed the launch's check, and its workers trained untracked. The 403 comes from
    a real MLflow server; the 401 and 404 answers from a stand-in (no auth app here)."""
    from hpsearch.tracking.server import api_refusal
    from stack_util import fake_mlflow

    with fake_mlflow(200) as ok:
        assert api_refusal(ok) is None
    with fake_mlflow(404) as other:  # a mistyped path: the client calls exactly this one
        assert "404 not found: no MLflow API under this URI" in (api_refusal(other) or "")
    with fake_mlflow(500) as other:  # another answer: the client will tell
        assert api_refusal(other) is None
    with fake_mlflow(401) as login:
        assert "401 unauthorized: give the server's login" in (api_refusal(login) or "")
        monkeypatch.setenv("MLFLOW_TRACKING_AUTH", "my_plugin")  # a login this read lacks
        assert api_refusal(login) is None
        monkeypatch.delenv("MLFLOW_TRACKING_AUTH")
    work = tmp_path / "w"
    # A real MLflow server whose --allowed-hosts does not list the host the URI names
    from hpsearch.tracking.server import start_local_server

    with start_local_server(tmp_path / "mlflow", allowed_hosts="mlflow.only.example") as server:
        refusing = server.url
        host = refusing.removeprefix("http://")
        r = hpsearch(
            ["launch", "--study", "tiny", "--workers", "2", "--workdir", str(work),
             "--train-fn", DUMMY, "--tracking-uri", refusing, "--set", "budget.max_epochs=1"],
            subprocess_env,
        )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: MLflow at {refusing}: 403 forbidden: the server refuses "
                           f"host '{host}'"), r.stderr  # fmt: skip
    assert not (work / "optuna.journal").exists() and not (work / "logs").exists()
    # A worker of its own (a remote host's): the same check, the same one line
    with fake_mlflow(401) as login:
        r = hpsearch(
            ["worker", "--study", "tiny", "--workdir", str(work), "--train-fn", DUMMY,
             "--tracking-uri", login],
            subprocess_env,
        )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"Error: MLflow at {login}: 401")


def test_hpsearch_alone_shows_its_help_not_a_one_line_error(
    subprocess_env: dict[str, str],
) -> None:
    r = hpsearch([], subprocess_env, timeout=120)
    assert r.returncode == 2 and "Error" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("Usage:") and "Commands:" in lines


def test_every_command_has_help_with_an_example() -> None:
    from hpsearch.cli import cli

    assert cli.help and "Example" in cli.help
    for name, cmd in cli.commands.items():
        assert cmd.help and "Example" in cmd.help, name
        for p in cmd.params:
            if getattr(p, "hidden", False) or p.name == "help":
                continue
            assert getattr(p, "help", None), f"{name} --{p.name} has no help"


HANG_SCRIPT = """
import concurrent.futures, gc, sys
from hpsearch.cli import _exit_without_teardown

class Holder:  # like an MLflow artifact repository: a pool kept alive by a reference cycle
    def __init__(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.me = self
        self.pool.submit(print, "job ran").result()

gc.disable()
Holder()
sys.stdout.write("exiting\\n")
_exit_without_teardown()
"""


def test_exit_without_teardown_wakes_idle_thread_pools() -> None:
    """The fast exit of a launcher or worker runs threading's exit hooks before it joins the
    non-daemon threads: an idle pool no one can reach any more must not keep it waiting."""
    done = subprocess.run(
        [sys.executable, "-c", HANG_SCRIPT], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["job ran", "exiting"]


def test_a_fixed_run_that_fails_first_keeps_the_earlier_runs_checkpoint(tmp_path: Path) -> None:
    """`hpsearch train` starts afresh, but sets the earlier run's checkpoint aside only until
    it writes its own: one that fails before (missing data here) leaves it in place."""
    import pytest
    from hpsearch.config import load_config
    from hpsearch.errors import DataError
    from hpsearch.runner import run_fixed

    cfg = load_config("tiny", data_dir=str(tmp_path / "nowhere"))
    ckpt = tmp_path / "train" / "tiny" / "fixed.pt"
    best = ckpt.with_name("fixed.best.pt")
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"an earlier run's epochs")
    best.write_bytes(b"an earlier run's best model")
    with pytest.raises(DataError, match="not found or incomplete"):
        run_fixed(cfg, '{"lr": 0.1, "batch_size": 32}', None, None, tmp_path, "cpu", None)
    assert ckpt.read_bytes() == b"an earlier run's epochs"
    assert best.read_bytes() == b"an earlier run's best model"
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["fixed.best.pt", "fixed.pt"]


def test_a_fixed_run_that_trained_to_its_end_keeps_no_stale_resume_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA: `train` named `fixed.pt` as its checkpoint after its last epoch: that file held
    the epoch before (none is written at the end), or was not there at all (a write given
    up at the end, which this trainer stands for). Nothing resumes it: it goes, and the
    best model stays."""
    from hpsearch import trainer
    from hpsearch.config import load_config
    from hpsearch.runner import run_fixed
    from hpsearch.trainer import TrainOptions
    from hpsearch.trainer.types import TrialResult

    folder = tmp_path / "train" / "tiny"

    def trained(cfg: object, params: object, report: object, options: TrainOptions) -> TrialResult:
        ckpt = options.checkpoint_path
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        ckpt.write_bytes(b"epoch 1 of 2")  # the last resume checkpoint it wrote
        ckpt.with_name("fixed.best.pt").write_bytes(b"best")
        return TrialResult(
            history=[], best_val_acc=0.5, best_val_loss=1.0, final_val_acc=0.5, test_acc=0.4,
            stop_reason="finished", epochs_run=2, pruned_at_epoch=None, checkpoint_path=ckpt,
            best_model_path=ckpt.with_name("fixed.best.pt"), effective_lr=0.05,
            effective_batch_size=32, micro_batch_size=32, train_seconds=1.0, setup_seconds=0.1,
            confusion=None, message="", num_classes=102, class_names=[],
        )  # fmt: skip

    monkeypatch.setattr(trainer, "train", trained)
    result = run_fixed(load_config("tiny"), '{"lr": 0.05, "batch_size": 32}', None, None,
                       tmp_path, "cpu", 0)  # fmt: skip
    assert result.checkpoint_path is None
    assert sorted(p.name for p in folder.iterdir()) == ["fixed.best.pt"]
    assert result.best_model_path == folder / "fixed.best.pt"


def test_a_work_folder_that_cannot_be_made_is_one_line(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for command in ("launch", "worker", "train"):
        r = hpsearch([command, "--study", "tiny", "--workdir", str(blocked / "w")], subprocess_env)
        assert r.returncode == 1, r.stdout + r.stderr
        assert r.stderr.strip() == (
            f"Error: --workdir: {blocked / 'w'}: cannot create or write there: Not a directory"
        ), r.stderr


def test_a_dashboard_on_no_study_or_that_cannot_listen_is_one_line(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    import socket

    empty = hpsearch(["dashboard", "--workdir", str(tmp_path)], subprocess_env)
    assert empty.returncode == 1 and "holds no Optuna study yet" in empty.stderr, empty.stderr
    # A journal named that is not there: a typo, said as `status` says it (QA).
    typo = tmp_path / "none.journal"
    r = hpsearch(["dashboard", "--storage", str(typo)], subprocess_env)
    assert r.stderr.strip() == f"Error: storage journal:{typo}: no such file", r.stderr
    assert not list(tmp_path.iterdir())  # a reader: no journal file made
    assert hpsearch(["init-storage", "--workdir", str(tmp_path)], subprocess_env).returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = hpsearch(["dashboard", "--workdir", str(tmp_path), "--port", str(port)], subprocess_env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.fullmatch(
        f"Error: --host/--port: 127.0.0.1:{port}: cannot listen there: Address already in use "
        r"\(--port (\d+) is free\)",
        r.stderr.strip(),
    ), r.stderr
    assert "optuna-dashboard: http" not in r.stdout  # it never listened


def test_a_budget_refused_names_the_option_that_gave_it(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """--trials 3000 was blamed on "--set budget.n_trials=3000", which the user never typed."""
    grid = ["--set", "sampler={name: grid}",
            "--set", "search_space={lr: {type: categorical, choices: [0.1, 0.01]}}"]  # fmt: skip
    for given, blamed in ((["--trials", "3000", "--set", "budget={max_epochs: 2}"],
                           "(from --trials 3000)"),
                          (["--set", "budget.n_trials=3000"],
                           "(from --set budget.n_trials=3000)")):  # fmt: skip
        r = hpsearch(["launch", "--study", "tiny", *given, *grid, "--workdir", str(tmp_path),
                      "--no-tracking"], subprocess_env)  # fmt: skip
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert "grid has 2 points" in r.stderr and r.stderr.endswith(f"{blamed}\n"), r.stderr


def test_ui_on_a_work_folder_that_is_not_there_is_one_line(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A mistyped --workdir (or HPSEARCH_WORKDIR) made the folder and an empty MLflow store
    there, and served it, where `status` and `studies` say there is no such folder."""
    typo = tmp_path / "runz"
    for args, env, given in (
        (["ui", "--workdir", str(typo)], subprocess_env, "--workdir"),
        (["ui"], dict(subprocess_env, HPSEARCH_WORKDIR=str(typo)), "HPSEARCH_WORKDIR"),
    ):
        r = hpsearch(args, env, cwd=tmp_path, timeout=60)
        assert r.returncode == 1, r.stdout + r.stderr
        assert (
            r.stderr == f"Error: {given}: {typo}: no such folder (launch a study there "
            "first, or create it)\n"
        ), r.stderr
        assert not typo.exists()


def test_a_dashboard_started_while_its_database_restarts_waits_for_it(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """`hpsearch dashboard` exited at once on a database that dropped its first connection
    ("cannot connect: server closed the connection unexpectedly", as during a restart: a
    compose stack starts it beside PostgreSQL); it now waits as a worker does, and a
    restart while it serves costs no page. A database that does not exist is still one
    line at once."""
    import urllib.request

    from hpsearch.tracking.server import free_port

    assert hpsearch(["init-storage", "--storage", pg_url], subprocess_env).returncode == 0
    later, port = url_up_later(pg_url, 3.0, drop=True), free_port()
    log = tmp_path / "dashboard.log"
    t0 = time.monotonic()
    proc = popen(["dashboard", "--storage", later, "--port", str(port)], subprocess_env, log)
    try:
        deadline = t0 + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5):
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        waited = time.monotonic() - t0
        # A restart once it serves: its pooled connection is dead, and the next page is
        # served all the same (it was a 500 error).
        terminate_backends(pg_url)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=30) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert waited >= 3.0
    said = log.read_text()
    assert re.search(r"^warning: storage \S+: database unreachable, retrying in", said, re.M)
    assert "UserWarning" not in said, said  # one line each, not Python's two
    wrong = pg_url.rsplit("/", 1)[0] + "/no_such_db_dash"
    t0 = time.monotonic()
    r = hpsearch(["dashboard", "--storage", wrong, "--port", str(free_port())], subprocess_env)
    assert r.returncode == 1 and time.monotonic() - t0 < 30, r.stderr
    assert r.stderr.count("\n") == 1 and "no_such_db_dash" in r.stderr, r.stderr


def test_train_trial_n_takes_the_config_the_trial_ran_with(
    tmp_path: Path, subprocess_env: dict[str, str], flowers_root: Path
) -> None:
    """It took the study file's: a study launched with --set dataset.image_size=24 was
    "reproduced" at the file's 32 px. Then it took the study's last launch's: a relaunch
    with other --set values changed how an earlier trial was reproduced."""
    from hpsearch.config import load_config
    from hpsearch.errors import ConfigError
    from hpsearch.runner import trial_config

    r = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "1",
                  "--workdir", str(tmp_path), "--train-fn", DUMMY, "--no-tracking",
                  "--set", "dataset.image_size=24", "--set", "dataset.cache_size=28",
                  "--set", "budget.max_epochs=1"], subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    file_cfg = load_config("tiny", data_dir=str(flowers_root))
    assert file_cfg.dataset.image_size == 32
    cfg = trial_config(file_cfg, None, tmp_path, ["dataset.eval_limit=102"])
    assert (cfg.dataset.image_size, cfg.dataset.cache_size) == (24, 28)
    assert cfg.budget.max_epochs == 1 and cfg.dataset.root == str(flowers_root)
    assert cfg.dataset.eval_limit == 102  # today's --set on top
    with pytest.raises(ConfigError, match=r"launched with\): budget.max_epochs: 0"):
        trial_config(file_cfg, None, tmp_path, ["budget.max_epochs=0"])
    run = hpsearch(["train", "--study", "tiny", "--trial", "0", "--workdir", str(tmp_path),
                    "--data-dir", str(flowers_root), "--set", "dataset.eval_limit=102"],
                   subprocess_env)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "finished: best_val_acc" in run.stdout and " epochs 1 " in run.stdout, run.stdout
    # The best model it wrote is named (it printed "checkpoint None": the resume file is gone).
    best = run.stdout.split(" best model ")[1].split()[0]
    assert Path(best).is_file() and best.endswith(".best.pt"), run.stdout
    assert "checkpoint None" not in run.stdout
    assert "MLflow run " in run.stdout  # on the work folder's server, started for it
    again = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "2",
                      "--workdir", str(tmp_path), "--train-fn", DUMMY, "--no-tracking",
                      "--set", "dataset.image_size=20", "--set", "dataset.cache_size=28",
                      "--set", "budget.max_epochs=2"], subprocess_env)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    sizes = {n: trial_config(file_cfg, None, tmp_path, trial_number=n).dataset.image_size
             for n in (0, 1)}  # fmt: skip
    assert sizes == {0: 24, 1: 20}
    first = trial_config(file_cfg, None, tmp_path, trial_number=0)
    assert first.budget.max_epochs == 1 and not first.dataset.download
    allowed = load_config("tiny", data_dir=str(flowers_root), download=True)
    assert trial_config(allowed, None, tmp_path, trial_number=0).dataset.download  # the file's
    assert trial_config(file_cfg, None, tmp_path).dataset.image_size == 20  # the last launch's
    # One recorded config per way trials train: not per --trials value or data folder.
    from hpsearch.study import CONFIG_OF_ATTR

    more = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "3",
                     "--workdir", str(tmp_path), "--train-fn", DUMMY, "--no-tracking",
                     "--data-dir", str(tmp_path / "elsewhere"),
                     "--set", "dataset.image_size=20", "--set", "dataset.cache_size=28",
                     "--set", "budget.max_epochs=2"], subprocess_env)  # fmt: skip
    assert more.returncode == 0, more.stdout + more.stderr
    attrs = hps.load_study("tiny", workdir=tmp_path).user_attrs
    assert len([k for k in attrs if k.startswith(CONFIG_OF_ATTR)]) == 2  # 24 and 20 px
    rerun = hpsearch(["train", "--study", "tiny", "--trial", "0", "--workdir", str(tmp_path),
                      "--data-dir", str(flowers_root), "--set", "dataset.eval_limit=102",
                      "--no-tracking"], subprocess_env)  # fmt: skip
    assert rerun.returncode == 0 and " epochs 1 " in rerun.stdout, rerun.stdout + rerun.stderr


def test_a_fixed_run_that_fails_late_puts_the_earlier_pair_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The earlier run's checkpoint and best model come back together; what the failed run
    wrote stays beside them. A run that succeeds replaces both."""
    import pytest
    from hpsearch import trainer
    from hpsearch.config import load_config
    from hpsearch.errors import HpsearchError
    from hpsearch.runner import run_fixed

    ckpt = tmp_path / "train" / "tiny" / "fixed.pt"
    best = ckpt.with_name("fixed.best.pt")
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"old epochs")
    best.write_bytes(b"old best")

    def fails_in_test_eval(cfg: object, params: object, report: object, options: object) -> None:
        best.write_bytes(b"new best")  # a short run writes only its best model
        raise RuntimeError("test split: out of memory")

    monkeypatch.setattr(trainer, "train", fails_in_test_eval)
    cfg = load_config("tiny")
    with pytest.raises(HpsearchError, match=r"training failed: RuntimeError: .* out of memory"):
        run_fixed(cfg, '{"lr": 0.1, "batch_size": 32}', None, None, tmp_path, "cpu", None)
    assert (ckpt.read_bytes(), best.read_bytes()) == (b"old epochs", b"old best")
    assert (ckpt.parent / "fixed.best.pt.failed").read_bytes() == b"new best"

    import types

    def best_not_saved(cfg: object, params: object, report: object, options: object) -> object:
        return types.SimpleNamespace(best_val_acc=0.5, best_model_path=None)  # disk full

    monkeypatch.setattr(trainer, "train", best_not_saved)
    run_fixed(cfg, '{"lr": 0.1, "batch_size": 32}', None, None, tmp_path, "cpu", None)
    assert (ckpt.read_bytes(), best.read_bytes()) == (b"old epochs", b"old best")

    def succeeds(cfg: object, params: object, report: object, options: object) -> object:
        best.write_bytes(b"newer best")
        return types.SimpleNamespace(best_val_acc=0.5, best_model_path=best)

    monkeypatch.setattr(trainer, "train", succeeds)
    result = run_fixed(cfg, '{"lr": 0.1, "batch_size": 32}', None, None, tmp_path, "cpu", None)
    assert result.best_model_path == best
    assert not ckpt.exists() and best.read_bytes() == b"newer best"
    assert sorted(p.name for p in ckpt.parent.iterdir()) == [
        "fixed.best.pt",
        "fixed.best.pt.failed",
    ]


def test_a_bad_fixed_param_is_blamed_on_params_not_the_study_file(tmp_path: Path) -> None:
    from hpsearch.config import load_config
    from hpsearch.errors import ConfigError
    from hpsearch.runner import fixed_params

    with pytest.raises(ConfigError, match=r"^--params: lr: -1: Input should be greater than 0$"):
        fixed_params(load_config("tiny"), '{"lr": -1}', None, None, tmp_path)


def test_an_empty_search_space_runs_the_defaults_and_says_so(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A study with nothing to search trains trainer.defaults in every trial: allowed (the
    packing bench measures fixed params so) but said, as it is rarely what a user meant."""
    r = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "1",
                  "--workdir", str(tmp_path / "w"), "--train-fn", DUMMY, "--no-tracking",
                  "--set", "search_space={}", "--set", "budget.max_epochs=1"],
                 subprocess_env, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "search_space is empty: every trial trains trainer.defaults" in r.stdout, r.stdout
    [trial] = hps.load_study("tiny", workdir=tmp_path / "w").get_trials()
    assert trial.params == {} and trial.state == TrialState.COMPLETE


def test_a_grid_study_trains_its_grid_and_ends_cleanly(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Optuna's grid sampler stops the study once the grid is covered, which works inside
    study.optimize only: from a worker's tell it raised after the trial was stored, so the
    last trial read as an error and the worker died."""
    space = "search_space={batch_size: {type: categorical, choices: [32, 48, 64]}}"
    r = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "3",
                  "--workdir", str(tmp_path), "--train-fn", DUMMY, "--no-tracking",
                  "--set", "sampler={name: grid}", "--set", space,
                  "--set", "budget.max_epochs=1", "--set", "pruner={name: none}"],
                 subprocess_env, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "error" not in r.stdout + r.stderr and "restarting" not in r.stdout + r.stderr
    trials = hps.load_study("tiny", workdir=tmp_path).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    assert sorted(t.params["batch_size"] for t in trials) == [32, 48, 64]
    log = (tmp_path / "logs" / "tiny-worker-0.log").read_text()
    assert "Traceback" not in log and "Cannot tell" not in log, log


def test_a_train_fn_whose_function_does_not_load_stops_its_worker_without_restarts(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: `--train-fn dummy_trainer:trian` (its module found before the launch) died in
    each worker and was restarted three times: the same import fails after each."""
    r = hpsearch(["launch", "--study", "tiny", "--trials", "1", "--workdir", str(tmp_path),
                  "--train-fn", "dummy_trainer:trian", "--no-tracking"], subprocess_env)  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "worker 0 died (exit code 78)" in r.stdout and "restarting" not in r.stdout, r.stdout
    assert "'dummy_trainer:trian': cannot import: AttributeError" in r.stdout, r.stdout


def test_every_trial_carries_the_memory_constraint_and_cmaes_says_nothing_of_it(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: every CMA-ES trial logged Optuna's "Constraints have been set, but CmaEsSampler
    will not use them": hpsearch's own out-of-memory constraint, on every trial. It went to
    the samplers that read it only, and a study that changed to GP then failed every ask
    (QA): it goes on every trial, and the worker silences CMA-ES's warning."""
    from optuna.study._constrained_optimization import _CONSTRAINTS_KEY

    for sampler in ("cmaes", "tpe"):
        work = tmp_path / sampler
        r = hpsearch(["launch", "--study", "tiny", "--trials", "4", "--workdir", str(work),
                      "--train-fn", DUMMY, "--no-tracking", "--set",
                      f"sampler={{name: {sampler}, seed: 0}}"], subprocess_env)  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        log = (work / "logs" / "tiny-worker-0.log").read_text()
        assert "Constraints have been set" not in log, log
        trials = hps.load_study("tiny", workdir=work).get_trials()
        constrained = [t for t in trials if f"{_CONSTRAINTS_KEY}:memory" in t.system_attrs]
        assert len(constrained) == 4, sampler


def test_a_train_run_whose_best_model_finds_no_room_exits_74(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: `hpsearch train` on a full disk trained, could not write its best model, and
    exited 0 with no model anywhere. A real 24 MiB tmpfs (mounted as root, as CI runs): a
    ResNet-18's best model is 43 MiB."""

    with tmpfs(tmp_path / "disk", "24M") as disk:
        r = hpsearch(["train", "--study", "tiny", "--params", '{"lr": 0.05}', "--workdir",
                      str(disk), "--no-tracking", "--device", "cpu", "--set",
                      "budget.max_epochs=1", "--set", "dataset.train_limit=64"],
                     subprocess_env)  # fmt: skip
        assert r.returncode == 74, r.stdout + r.stderr
        assert (
            "Error: the run trained, and kept no model: not saved: fixed.best.pt (no space "
            "left on device (" in r.stderr
        ), r.stderr
        assert "not cached at" in r.stderr  # its data cache, kept in memory


def test_a_weights_file_of_another_model_is_refused_before_any_worker(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: a resnet34 (or a broken) `model.weights` file in a resnet18 study failed every
    trial, three in a row per worker and three restarts: twelve failed trials for a budget
    of one. It is checked once, against each arch the study trains, before any worker."""
    import torch
    import torchvision
    from hpsearch.config import load_config
    from hpsearch.errors import ConfigError
    from hpsearch.runner import check_weights

    other = tmp_path / "linear.pth"
    torch.save(torch.nn.Linear(2, 2).state_dict(), other)
    r = hpsearch(["launch", "--study", "tiny", "--workdir", str(tmp_path / "w"), "--no-tracking",
                  "--set", f"model.weights={other}"], subprocess_env)  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().endswith(
        f"tiny.yaml: model.weights: {other}: does not match the model (100 missing keys, 2 "
        "unexpected, e.g. conv1.weight) (for arch resnet18)"
    ), r.stderr
    assert not (tmp_path / "w" / "logs").exists()  # no worker started
    mine = tmp_path / "r18.pth"
    torch.save(torchvision.models.resnet18(num_classes=5).state_dict(), mine)
    check_weights(load_config("tiny", [f"model.weights={mine}"]))  # its own arch: fine
    searched = [f"model.weights={mine}",
                "search_space.arch={type: categorical, choices: [resnet18, mobilenet_v3_small]}"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"mobilenet_v3_small \(searched: one weights file"):
        check_weights(load_config("tiny", searched))
    check_weights(load_config("tiny", searched), "resnet18")  # `train`: its run's arch only


def test_a_worker_joins_a_study_by_its_name_with_the_launchs_config_and_is_told_of_its_own(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: a teammate's worker could not join by the study's name (the config is stored on
    the study), rebuilt the file with other --set values, and trained 3-epoch 24 px trials
    beside the launch's 1-epoch 32 px ones without a word; one of them became "best"."""
    from hpsearch.study import CONFIG_ID_ATTR

    work = tmp_path / "w"
    common = ["--workdir", str(work), "--train-fn", DUMMY, "--no-tracking"]
    r = hpsearch(["launch", "--study", "tiny", "--set", "name=team", "--set",
                  "budget.max_epochs=1", "--trials", "2", *common], subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    r = hpsearch(["worker", "--study", "team", "--trials", "3", *common], subprocess_env,
                 cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0 and "warning" not in r.stderr, r.stdout + r.stderr
    study = hps.load_study("team", workdir=work)
    ids = [t.user_attrs.get(CONFIG_ID_ATTR) for t in study.trials]
    assert len(ids) == 3 and len(set(ids)) == 1, ids  # the launch's config
    assert all(max(t.intermediate_values) == 1 for t in study.trials)
    # Its own file with other settings: allowed (a quick check), but said in one line.
    r = hpsearch(["worker", "--study", "tiny", "--set", "name=team", "--set",
                  "budget.max_epochs=2", "--trials", "4", *common], subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    warned = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: ")]
    assert warned == [
        "warning: study team: this worker's trials train otherwise than its last launch's "
        "(budget.max_epochs: 2 (the launch's: 1)): their values will not compare; "
        "`--study team` alone takes the launch's config"
    ], r.stderr
    # Review: what is this host's business (its loader, cache, checkpoints) is not told.
    r = hpsearch(["worker", "--study", "tiny", "--set", "name=team", "--set",
                  "budget.max_epochs=1", "--set", "trainer.num_workers=2", "--set",
                  "dataset.fast_path=off", "--set", "tracking.keep_top_k=1", "--set",
                  "enqueue_trials=[]", "--trials", "4", *common], subprocess_env)  # fmt: skip
    assert r.returncode == 0 and "warning" not in r.stderr, r.stdout + r.stderr
    # The launch's own workers are never told (a relaunch's new settings are the launch's).
    r = hpsearch(["launch", "--study", "tiny", "--set", "name=team", "--set",
                  "budget.max_epochs=3", "--trials", "5", *common], subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    logs = "".join(p.read_text() for p in (work / "logs").glob("team-worker-*.log"))
    assert "trial 4" in logs and "train otherwise" not in logs, logs
    r = hpsearch(["worker", "--study", "nosuch", *common], subprocess_env, cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.strip().startswith("Error: --study: 'nosuch': no such study file; known")
    assert r.stderr.strip().endswith(
        "; nor is 'nosuch' a study in the storage with a config a launch stored"
    ), r.stderr


def test_a_worker_joins_a_study_of_a_shipped_files_name_with_the_launchs_config(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """`worker --study tiny` took the shipped file, not the values the launch of study
    tiny set on top of it: told it trained otherwise, it had no way to join by the name."""
    from hpsearch.study import CONFIG_ID_ATTR

    common = ["--workdir", str(tmp_path / "w"), "--train-fn", DUMMY, "--no-tracking"]
    r = hpsearch(["launch", "--study", "tiny", "--set", "budget.max_epochs=1", "--trials", "2",
                  *common], subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    r = hpsearch(["worker", "--study", "tiny", "--trials", "3", *common], subprocess_env)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stdout + r.stderr
    study = hps.load_study("tiny", workdir=tmp_path / "w")
    assert len({t.user_attrs.get(CONFIG_ID_ATTR) for t in study.trials}) == 1
    assert [max(t.intermediate_values) for t in study.trials] == [1, 1, 1]
    # A new study of that name in another storage: the shipped file, as before.
    r = hpsearch(["worker", "--study", "tiny", "--trials", "1", "--workdir", str(tmp_path / "x"),
                  "--train-fn", DUMMY, "--no-tracking"], subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    fresh = hps.load_study("tiny", workdir=tmp_path / "x").trials
    assert max(fresh[0].intermediate_values) > 1  # the shipped budget.max_epochs
    # Its own values on top: told, with the way to join as the launch trains.
    r = hpsearch(["worker", "--study", "tiny", "--set", "budget.max_epochs=2", "--trials", "4",
                  *common], subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        "(budget.max_epochs: 2 (the launch's: 1)): their values will not compare; "
        "`--study tiny` alone takes the launch's config" in r.stderr
    ), r.stderr


def test_a_worker_joining_by_a_shipped_name_waits_for_a_database_still_starting(
    pg_url: str, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """Review: a worker whose database was not up yet took the shipped file's config for
    good, though the study it then joined had the launch's."""
    common = ["--workdir", str(tmp_path), "--train-fn", DUMMY, "--no-tracking"]
    r = hpsearch(["launch", "--study", "tiny", "--storage", pg_url, "--trials", "1",
                  "--set", "budget.max_epochs=1", *common], subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    later = url_up_later(pg_url, 3.0)
    r = hpsearch(["worker", "--study", "tiny", "--storage", later, "--trials", "2", *common],
                 subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "database unreachable, retrying" in r.stderr and "train otherwise" not in r.stderr
    trials = hps.load_study("tiny", storage=pg_url).trials
    assert [max(t.intermediate_values) for t in trials] == [1, 1]


def test_a_study_launched_before_a_rule_for_new_files_relaunches_from_its_unchanged_file(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A rule newer than a study (here: a `when` value given twice) refused to relaunch it from
    the very file it was launched from, which its stored config is spared."""
    from hpsearch.config import config_to_yaml, find_study_file, load_config
    from hpsearch.study import CONFIG_ATTR

    text = find_study_file("tiny").read_text()  # the shipped one
    old = tmp_path / "old.yaml"
    twice = "when: {loss: [label_smoothing, label_smoothing]}"
    old.write_text(
        text.replace("name: tiny", "name: old").replace("when: {loss: label_smoothing}", twice)
    )
    work = tmp_path / "w"
    common = ["launch", "--study", str(old), "--workers", "1", "--workdir", str(work),
              "--train-fn", DUMMY, "--no-tracking"]  # fmt: skip
    r = hpsearch([*common, "--trials", "1"], subprocess_env)
    assert (
        r.returncode == 1
        and "label_smoothing.when.loss: 'label_smoothing': given twice" in r.stderr
    ), r.stderr
    assert not work.exists()  # refused before anything was made
    # The study as an earlier hpsearch launched it from that file.
    ok = tmp_path / "ok.yaml"
    ok.write_text(old.read_text().replace(twice, "when: {loss: label_smoothing}"))
    r = hpsearch(["launch", "--study", str(ok), "--workers", "1", "--workdir", str(work),
                  "--train-fn", DUMMY, "--no-tracking", "--trials", "1"], subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    study = hps.load_study("old", workdir=work)
    study.set_user_attr(CONFIG_ATTR, config_to_yaml(load_config(old, lenient=True)))
    r = hpsearch([*common, "--trials", "2"], subprocess_env)
    assert r.returncode == 0, r.stdout + r.stderr
    warned = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: ")]
    assert warned == [
        f"warning: {old}: search_space.label_smoothing.when.loss: 'label_smoothing': given "
        "twice; allowed for study "
        "old, launched from it before this rule (a new study file is refused so)"
    ], r.stderr
    last = r.stdout.splitlines()[-1]  # its workers took the file too
    assert last.startswith("done (budget): complete") and "failed 0" in last, r.stdout
    # Edited since: held to today's rules.
    r = hpsearch([*common, "--trials", "3", "--set", "budget.max_epochs=1"], subprocess_env)
    assert r.returncode == 1 and "given twice" in r.stderr and "allowed" not in r.stderr


def test_a_resumed_launchs_eta_is_at_its_own_rate_not_counting_earlier_trials(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """QA: a relaunch showed "eta 1s" with three 2-minute trials left: it divided its own
    seconds by every finished trial of the study, the earlier launches' too."""
    common = ["launch", "--study", "tiny", "--workers", "1", "--workdir", str(tmp_path),
              "--train-fn", DUMMY, "--no-tracking", "--set", "pruner.name=none",
              "--set", "pruner.options={}", "--set", "budget.max_epochs=2"]  # fmt: skip
    first = hpsearch([*common, "--trials", "8"], subprocess_env)
    assert first.returncode == 0, first.stdout + first.stderr
    env = dict(subprocess_env, HPSEARCH_DUMMY_EPOCH_S="1.5")  # a trial: 3 s and more
    again = hpsearch([*common, "--trials", "10"], env)
    assert again.returncode == 0, again.stdout + again.stderr
    shown = re.findall(r"\[ *(\d+)s\] complete 9 .* / 10 \| best .* \| eta (\d+)s", again.stdout)
    assert shown, again.stdout
    elapsed, eta = map(int, shown[0])
    # One trial finished here in `elapsed` s and the last one has trained 0 or 1 of its 2
    # epochs: elapsed or elapsed / 3 left at that rate (it was elapsed / 9).
    assert eta >= elapsed / 3 - 1, again.stdout
    # A relaunch whose budget is spent says so (QA: `/ 4` beside 5 finished, no word).
    spent = hpsearch([*common, "--trials", "5"], subprocess_env)
    assert spent.returncode == 0, spent.stdout + spent.stderr
    assert (
        "study tiny has 10 finished trials, budget.n_trials is 5: none runs; --trials N "
        "(N above 10) runs more"
    ) in spent.stdout.splitlines(), spent.stdout


def test_a_multi_objective_launch_shows_its_pareto_front_not_best_dash(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Its progress and its last line said `best -` from start to end (QA)."""
    r = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "3",
                  "--workdir", str(tmp_path), "--train-fn", DUMMY, "--no-tracking",
                  "--set", "objective={metric: [val_acc, val_loss], direction: [maximize, minimize]}",
                  "--set", "pruner.name=none", "--set", "pruner.options={}"],
                 subprocess_env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    study = hps.load_study("tiny", workdir=tmp_path)
    front = sorted(study.best_trials, key=lambda t: (-t.values[0], t.number))
    assert front, [t.values for t in study.trials]
    numbers = ", ".join(str(t.number) for t in front)
    many = "s" if len(front) > 1 else ""
    done = [ln for ln in r.stdout.splitlines() if ln.startswith("done (")]
    assert done and done[0].endswith(f"| best pareto {len(front)} (trial{many} {numbers})"), done


def test_a_seeded_grid_trains_each_point_once_over_workers_and_relaunches(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The grid sampler's seed shuffles the grid and a trial's `grid_id` indexes it: with a
    seed of its own per worker (and per relaunch) a grid id meant another point in each,
    so a 2-worker launch trained one point twice and never another (QA: 4-point grid)."""
    from hpsearch.config import load_config
    from hpsearch.study import make_sampler

    sets = ["--set", "sampler={name: grid, seed: 5}", "--set", "budget.max_epochs=1",
            "--set", "search_space={batch_size: {type: categorical, choices: [16, 32, 48, 64]}, "
                     "lr: {type: float, low: 0.01, high: 0.02, step: 0.01}}",
            "--set", "pruner={name: none}"]  # fmt: skip
    cfg = load_config("tiny", [s for s in sets if s != "--set"])
    samplers = [make_sampler(cfg, stream, before) for stream, before in ((0, 0), (1, 0), (0, 3))]
    assert len({tuple(s._all_grids) for s in samplers}) == 1  # type: ignore[attr-defined]
    # Which unvisited id a trial past the grid's size takes (built outside the study lock)
    # is each worker's own draw: with one seed, two workers took the same point each time.
    picks = {s._rng.rng.randint(2**30) for s in samplers}  # type: ignore[attr-defined]
    assert len(picks) == 3
    for trials in (5, 8):  # a launch, then a relaunch that resumes it
        r = hpsearch(["launch", "--study", "tiny", "--workers", "2", "--trials", str(trials),
                      "--workdir", str(tmp_path), "--train-fn", DUMMY, "--no-tracking", *sets],
                     subprocess_env, timeout=240)  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
    trials = hps.load_study("tiny", workdir=tmp_path).trials
    points = [(t.params["batch_size"], t.params["lr"]) for t in trials]
    assert len(points) == 8 and len(set(points)) == 8, points


def test_workers_of_one_seed_propose_different_parameters(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Workers sharing the study's sampler seed drew the same random start-up parameters
    (the review found trials 0 and 1 of a 2-worker launch alike, and a restarted worker
    repeating trial 0). Each worker now draws from its own stream; one worker on a fresh
    study still draws what plain Optuna draws with the study's seed."""
    import optuna
    from hpsearch.config import load_config
    from hpsearch.study import suggest

    sets = ["--set", "sampler={name: random, seed: 3}", "--set", "budget.max_epochs=1",
            "--set", "pruner={name: none}"]  # fmt: skip
    two = tmp_path / "two"
    r = hpsearch(["launch", "--study", "tiny", "--workers", "2", "--trials", "6",
                  "--workdir", str(two), "--train-fn", DUMMY, "--no-tracking", *sets],
                 subprocess_env, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    drawn = [tuple(sorted(t.params.items())) for t in hps.load_study("tiny", workdir=two).trials]
    assert len(drawn) == 6 and len(set(drawn)) == 6, drawn

    one = tmp_path / "one"
    r = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "2",
                  "--workdir", str(one), "--train-fn", DUMMY, "--no-tracking", *sets],
                 subprocess_env, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = load_config("tiny", [s for s in sets if s != "--set"])
    plain = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    expected = []
    for _ in range(2):
        trial = plain.ask()
        expected.append(suggest(trial, cfg))
        plain.tell(trial, 0.0)
    got = [t.params for t in hps.load_study("tiny", workdir=one).trials]
    assert got == expected


def test_a_second_launch_of_a_study_in_one_work_folder_is_refused(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Two launches in one folder named their workers alike and shared their logs; the
    second's Ctrl-C failed the first's running trial. Now the second is one line, and the
    first goes on untouched."""
    work = tmp_path / "w"
    # 3 epochs of 3 s: the first launch still holds its lock while a second interpreter
    # starts and imports on a loaded machine.
    env = dict(subprocess_env, HPSEARCH_DUMMY_EPOCH_S="3")
    args = ["launch", "--study", "tiny", "--workers", "1", "--trials", "1", "--workdir",
            str(work), "--train-fn", DUMMY, "--no-tracking", "--set", "budget.max_epochs=3",
            "--set", "pruner={name: none}"]  # fmt: skip
    first = popen(args, env, tmp_path / "first.log")
    try:
        lock = work / "run" / "tiny.lock"
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().strip()):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.1)
        second = hpsearch(args, env, timeout=60)
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"is already being launched from {work} (pid {first.pid})" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
        assert first.wait(120) == 0, (tmp_path / "first.log").read_text()
    finally:
        first.kill()
    [trial] = hps.load_study("tiny", workdir=work).get_trials()
    assert trial.state == TrialState.COMPLETE
    again = hpsearch([*args[:6], "2", *args[7:]], env, timeout=120)  # the lock went with it
    assert again.returncode == 0, again.stdout + again.stderr


def test_a_refused_second_launch_leaves_the_first_ones_files_and_gpus_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--workers auto` wrote the study file and probed the GPUs before the launch lock
    refused it: the running launch's restarted workers took the second command's config,
    and the probe trained on GPUs packed full."""
    from click.testing import CliRunner
    from hpsearch import cli, launcher

    work = tmp_path / "w"
    first = launcher.hold_launch_lock(work, "tiny")  # the running launch
    study_file = work / "run" / "tiny.yaml"
    study_file.write_text("the first launch's\n")
    probed: list[object] = []
    monkeypatch.setattr(launcher, "auto_workers", lambda *a, **k: probed.append(a))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    try:
        r = CliRunner().invoke(cli.cli, ["launch", "--study", "tiny", "--workers", "auto",
                                         "--workdir", str(work), "--train-fn", DUMMY,
                                         "--no-tracking"])  # fmt: skip
    finally:
        first.close()
    assert r.exit_code == 1 and "is already being launched" in r.output, r.output
    assert probed == [] and study_file.read_text() == "the first launch's\n"


def test_a_stop_while_workers_start_starts_no_more(tmp_path: Path) -> None:
    """Ctrl-C between two worker starts: workers started after it never got the stop and
    trained through the grace period (and --workers 1000000 went on starting)."""
    from hpsearch.config import load_config
    from hpsearch.launcher import Launcher, LaunchOptions
    from hpsearch.storage import resolve_storage

    cfg = load_config("tiny", ["budget.max_epochs=1"])
    work = tmp_path / "w"
    opts = LaunchOptions(workers=3, workdir=work, device="cpu", tracking=False,
                         train_fn=DUMMY, grace_s=30)  # fmt: skip
    launcher = Launcher(cfg, resolve_storage(None, work), opts)
    real = launcher._spawn

    def spawn_then_stop(*args: object) -> None:
        real(*args)  # type: ignore[arg-type]
        launcher.stop()  # the Ctrl-C lands right after the first worker started

    launcher._spawn = spawn_then_stop  # type: ignore[method-assign]
    t0 = time.monotonic()
    launcher.run()
    assert len(launcher._slots) == 1
    assert time.monotonic() - t0 < 25  # not the 30 s grace: the one started got the stop


def test_worker_counts_and_heartbeats_past_any_use_are_refused(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    r = hpsearch(["launch", "--study", "tiny", "--workers", "1000000",
                  "--workdir", str(tmp_path)], subprocess_env)  # fmt: skip
    assert r.returncode == 2 and "at most 256 workers per launch" in r.stderr
    r = hpsearch(["worker", "--study", "tiny", "--heartbeat", "99999999999",
                  "--workdir", str(tmp_path)], subprocess_env)  # fmt: skip
    assert r.returncode == 2 and "'--heartbeat': 99999999999 is not in the range" in r.stderr
    assert "1<=x<=3600" in r.stderr, r.stderr


def test_a_fixed_run_the_trainer_fails_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flowers_root: Path
) -> None:
    """`hpsearch train` with params the model cannot train (BatchNorm's "Expected more than
    1 value per channel" at batch 1, say) printed a traceback: now one line, like the
    message a trial of the search records."""
    import hpsearch.trainer
    from hpsearch.config import load_config
    from hpsearch.errors import HpsearchError
    from hpsearch.runner import run_fixed

    def failing(*args: object) -> None:
        raise ValueError("Expected more than 1 value per channel when training")

    monkeypatch.setattr(hpsearch.trainer, "train", failing)
    cfg = load_config("tiny", data_dir=str(flowers_root))
    with pytest.raises(HpsearchError, match=r"^training failed: ValueError: Expected more"):
        run_fixed(cfg, '{"batch_size": 32}', None, None, tmp_path, "cpu", None)


def test_a_flowers_folder_without_its_labels_is_refused_before_any_worker(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    base = tmp_path / "data" / "flowers-102"
    (base / "jpg").mkdir(parents=True)
    (base / "setid.mat").write_bytes(b"")
    r = hpsearch(["launch", "--study", "tiny", "--data-dir", str(tmp_path / "data"),
                  "--workdir", str(tmp_path / "w"), "--no-tracking"], subprocess_env)  # fmt: skip
    assert r.returncode == 65 and "not found or incomplete" in r.stderr, r.stderr
    assert not (tmp_path / "w" / "logs").exists() or not any((tmp_path / "w" / "logs").iterdir())


def test_a_work_folder_whose_logs_is_a_file_is_one_line(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    work = tmp_path / "w"
    work.mkdir()
    (work / "logs").write_text("not a folder")
    r = hpsearch(["launch", "--study", "tiny", "--workdir", str(work), "--train-fn", DUMMY,
                  "--no-tracking", "--set", "budget.max_epochs=1"], subprocess_env)  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"Error: --workdir: {work}: cannot write {work / 'logs'}: File exists"
    ], r.stderr


def test_two_studies_of_one_work_folder_share_its_server_until_the_last_ends(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Two launches (two studies) in one work folder log to its one embedded server. The
    one that started it stopped it when it ended, and the other's later epochs and runs were
    lost. Now the server runs until its last user ends, and that one stops it."""
    from hpsearch.tracking.server import running_server_url, state_path
    from mlflow import MlflowClient

    work = tmp_path / "w"
    env = dict(subprocess_env, HPSEARCH_DUMMY_EPOCH_S="1")
    common = ["--workers", "1", "--workdir", str(work), "--train-fn", DUMMY,
              "--set", "pruner={name: none}"]  # fmt: skip
    first = popen(["launch", "--study", "tiny", "--trials", "50", *common,
                   "--set", "budget.max_epochs=3"], env, tmp_path / "first.log")  # fmt: skip
    second = None
    try:
        deadline = time.monotonic() + 120
        while running_server_url(work) is None:  # the first launch's server is up
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.2)
        pgid = json.loads(state_path(work).read_text())["pgid"]
        second = popen(["launch", "--study", "tiny", "--set", "name=tiny_b", "--trials", "4",
                        *common, "--set", "budget.max_epochs=5"], env, tmp_path / "second.log")  # fmt: skip
        while "MLflow UI: " not in (tmp_path / "second.log").read_text():  # it joined
            assert time.monotonic() < deadline and second.poll() is None
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)  # the first ends while the second trains
        assert first.wait(60) == 130  # 128 + SIGINT
        first_ended_ms = time.time() * 1000
        log = (tmp_path / "first.log").read_text()
        assert "MLflow server left running: another search" in log, log
        assert group_alive(pgid) and second.poll() is None
        assert second.wait(180) == 0, (tmp_path / "second.log").read_text()
        assert not group_alive(pgid) and not state_path(work).exists()  # the last one stopped it
    finally:
        first.kill()
        if second is not None:
            second.kill()
    trials = hps.load_study("tiny_b", workdir=work).get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    from hpsearch.tracking.server import start_local_server

    with start_local_server(work) as server:
        client = MlflowClient(server.url)
        stamps = []
        for trial in trials:
            run = client.get_run(trial.user_attrs["mlflow_run_id"])
            assert run.info.status == "FINISHED"
            history = client.get_metric_history(run.info.run_id, "val_acc")
            assert len(history) == 5
            stamps += [m.timestamp for m in history]
        assert max(stamps) > first_ended_ms  # logged after the first launch had ended


def test_a_database_error_that_is_no_outage_is_one_line(
    pg_url: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A role that may connect but not read Optuna's tables (a team's read-only login
    without its grants): Optuna's StorageInternalError came out as a 40-line traceback."""
    import uuid

    import optuna
    import sqlalchemy as sa

    optuna.create_study(study_name="x", storage=pg_url)
    role = f"hps_ro_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
    try:
        url = pg_url.replace("postgresql://postgres@", f"postgresql://{role}@")
        r = hpsearch(["status", "--study", "x", "--storage", url], subprocess_env)
        assert r.returncode == 1, r.stdout + r.stderr
        err = r.stderr.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        assert err.startswith("Error: ") and "permission denied" in err, err
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))
        admin.dispose()


def test_a_full_disk_met_outside_the_librarys_checks_is_one_line() -> None:
    """The launcher's last journal writes on a full disk went out as chained tracebacks:
    the CLI's edge now says which file and why in one line; other OS errors (a bug's)
    still show their traceback."""
    import errno

    import click
    from hpsearch.cli import _edge

    @_edge
    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/w/.hpsearch/optuna.journal")

    with pytest.raises(click.ClickException) as info:
        full()
    assert info.value.message == "/w/.hpsearch/optuna.journal: No space left on device"

    @_edge
    def other() -> None:
        raise OSError(errno.EBADF, "Bad file descriptor")

    with pytest.raises(OSError, match="Bad file descriptor"):
        other()

    @_edge
    def signal_refused() -> None:  # no file: a bug's (a signal to a foreign process, say)
        raise PermissionError(errno.EPERM, "Operation not permitted")

    with pytest.raises(PermissionError):
        signal_refused()


def test_a_worker_stopped_by_a_full_disk_is_not_restarted_by_the_launcher() -> None:
    """Each restart of a worker stopped by the disk check stopped the same way (three per
    slot); its exit code now tells the launcher so. Other library errors exit 1."""
    import click
    from hpsearch.cli import _edge
    from hpsearch.errors import EXIT_DISK_FULL, CheckpointError, DiskFullError
    from hpsearch.launcher import should_restart

    for exc, code in ((DiskFullError("w: 10 MiB free"), EXIT_DISK_FULL),
                      (CheckpointError("w: not writable"), 1)):  # fmt: skip

        @_edge
        def stops(exc: Exception = exc) -> None:
            raise exc

        with pytest.raises(click.ClickException) as info:
            stops()
        assert info.value.exit_code == code and info.value.message == str(exc)
        # while the disk is still full (the launcher looks again as the exit is seen)
        assert should_restart(info.value.exit_code, 0, 3, True, disk_full=True) is (code == 1)


# Imported first by every Python process started with its folder on PYTHONPATH: the work
# folder's file system then reports 10 MiB free (statvfs), to the launcher and its workers.
FULL_DISK_HOOK = """
import os
_real = os.statvfs
class _Full:
    def __init__(self, real):
        self._real, self.f_bavail, self.f_frsize = real, 2560, 4096  # 10 MiB
    def __getattr__(self, name):
        return getattr(self._real, name)
def _statvfs(path):
    real = _real(path)
    full = os.path.realpath(os.environ["FAKE_FULL_DISK"])
    return _Full(real) if os.path.realpath(os.fspath(path)) == full else real
os.statvfs = _statvfs
"""


def test_a_launch_whose_work_folder_disk_is_full_says_so_in_one_line(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Every worker stops before it asks, none is restarted, and the launch's last line
    names the disk (it said "every worker crashed"), exit 74 as each worker's (it was 1);
    no trial is left failed."""
    work, hook = tmp_path / "w", tmp_path / "hook"
    work.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FULL_DISK_HOOK)
    env = dict(subprocess_env, FAKE_FULL_DISK=str(work))
    env["PYTHONPATH"] = os.pathsep.join([str(hook), env["PYTHONPATH"]])
    done = hpsearch(["launch", "--study", "tiny", "--workers", "2", "--trials", "2",
                     "--workdir", str(work), "--train-fn", DUMMY, "--no-tracking"],
                    env, timeout=180)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 74, out
    assert out.count("died (exit code 74); not restarted (its work folder's disk has no room") == 2
    last = out.strip().splitlines()[-1]
    assert last.startswith("Error: every worker stopped: work folder ") and "10 MiB free" in last
    assert hps.load_study("tiny", workdir=work).get_trials(deepcopy=False) == []


def _add_class(root: Path, name: str) -> None:
    """Three small random PNGs of class `name` in train/ and val/ of an image folder."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(len(name))
    for split in ("train", "val"):
        d = root / split / name
        d.mkdir(parents=True)
        for i in range(3):
            arr = rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)
            Image.fromarray(arr).save(d / f"{i}.png")


def test_a_data_error_stops_the_workers_once_not_every_trial_and_restart(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A corrupt image under on_corrupt: fail failed every trial: three in a row per worker,
    then three restarts of it: twelve failed trials on two workers for one file (QA). A
    worker stops at its first (exit 65) and is not restarted; the launch says why."""
    for c in ("daisy", "rose"):
        _add_class(tmp_path / "data", c)
    (tmp_path / "data" / "train" / "rose" / "broken.jpg").write_bytes(b"not a jpeg")
    data = f"dataset={{name: imagefolder, root: {tmp_path / 'data'}, image_size: 16, on_corrupt: fail}}"
    r = hpsearch(["launch", "--study", "tiny", "--workers", "2", "--trials", "6",
                  "--workdir", str(tmp_path / "w"), "--no-tracking", "--set", data],
                 subprocess_env, timeout=300)  # fmt: skip
    assert r.returncode == 65, r.stdout + r.stderr  # as a dataset refused up front (QA: 1)
    out = r.stdout + r.stderr
    assert "restarting" not in out, out
    assert out.count("not restarted (its data failed") == 2, out
    last = r.stderr.strip().splitlines()[-1]
    assert re.match(
        r"Error: every worker stopped, its data failed: worker \S+: dataset imagefolder: "
        r"cannot decode .*broken\.jpg",
        last,
    ), last
    trials = hps.load_study("tiny", workdir=tmp_path / "w").trials
    assert [t.state.name for t in trials] == ["FAIL", "FAIL"], out


def test_a_relaunch_on_an_image_folder_whose_classes_changed_is_refused(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A class added to the folder between launches: the retry's checkpoint did not load
    (a raw size mismatch), and 5- and 6-class values shared one study (QA). Each worker
    checks the classes against those the study's trials trained on, and stops (65); the
    launch checks first, before it replaces the study's config and budget (QA: a worker
    joining by the name then trained the refused config)."""
    from hpsearch.study import CONFIG_ATTR, N_TRIALS_ATTR

    _add_class(tmp_path / "data", "daisy")
    _add_class(tmp_path / "data", "rose")
    data = f"dataset={{name: imagefolder, root: {tmp_path / 'data'}, image_size: 16}}"
    args = ["launch", "--study", "tiny", "--workers", "1", "--workdir", str(tmp_path / "w"),
            "--no-tracking", "--set", data, "--set", "budget.max_epochs=1"]  # fmt: skip
    r = hpsearch([*args, "--trials", "1"], subprocess_env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (trained,) = hps.load_study("tiny", workdir=tmp_path / "w").trials
    assert trained.user_attrs["torch_threads"] >= 1  # what `train --trial 0` takes
    before = dict(hps.load_study("tiny", workdir=tmp_path / "w").user_attrs)
    _add_class(tmp_path / "data", "aaa_tulip")  # sorted first: every class index shifts
    r = hpsearch([*args, "--trials", "2", "--set", "dataset.eval_limit=2"], subprocess_env)
    assert r.returncode == 65, r.stdout + r.stderr
    assert "3 classes (added aaa_tulip) where the study's trials trained on 2" in r.stderr
    study = hps.load_study("tiny", workdir=tmp_path / "w")
    assert len(study.trials) == 1
    assert study.user_attrs[CONFIG_ATTR] == before[CONFIG_ATTR]
    assert study.user_attrs[N_TRIALS_ATTR] == before[N_TRIALS_ATTR] == 1
    # A worker of its own finds it so too, and stops (65).
    w = hpsearch(["worker", "--study", "tiny", "--workdir", str(tmp_path / "w"), "--no-tracking",
                  "--set", data, "--set", "budget.max_epochs=1"], subprocess_env, timeout=300)  # fmt: skip
    assert w.returncode == 65, w.stdout + w.stderr
    assert "3 classes (added aaa_tulip)" in w.stdout + w.stderr
    assert len(hps.load_study("tiny", workdir=tmp_path / "w").trials) == 1


def test_a_trials_own_data_error_fails_that_trial_and_the_search_goes_on(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A DataError of one trial's (its arch's pretrained weights missing offline) is no
    dataset error: the trial fails and the worker goes on, where a DatasetError stops it
    (review: one arch's missing weights ended a launch whose other trials trained)."""
    (tmp_path / "oneoff.py").write_text(
        "import os\n"
        "from dummy_trainer import train as dummy\n"
        "from hpsearch.errors import DataError\n"
        "def train(config, params, report, options=None):\n"
        f"    marker = {str(tmp_path / 'raised')!r}\n"
        "    if not os.path.exists(marker):\n"
        "        open(marker, 'w').close()\n"
        "        raise DataError('model resnet34: pretrained weights not found, download failed')\n"
        "    return dummy(config, params, report, options)\n"
    )
    env = {**subprocess_env,
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{subprocess_env.get('PYTHONPATH', '')}"}  # fmt: skip
    r = hpsearch(["launch", "--study", "tiny", "--workers", "1", "--trials", "3",
                  "--workdir", str(tmp_path / "w"), "--train-fn", "oneoff:train",
                  "--no-tracking", "--set", "budget.max_epochs=1", "--set", "pruner={name: none}"],
                 env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    states = [t.state.name for t in hps.load_study("tiny", workdir=tmp_path / "w").trials]
    assert states == ["FAIL", "COMPLETE", "COMPLETE", "COMPLETE"], (states, r.stdout)


def test_a_train_run_that_diverges_exits_non_zero(
    tmp_path: Path, subprocess_env: dict[str, str], flowers_root: Path
) -> None:
    """QA: `train` exited 0 on a diverged run (no model), printing Python's None."""
    r = hpsearch(["train", "--study", "tiny", "--params", '{"lr": 1e9}', "--no-tracking",
                  "--workdir", str(tmp_path), "--data-dir", str(flowers_root),
                  "--set", "budget.max_epochs=1", "--set", "dataset.eval_limit=102"],
                 subprocess_env)  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("diverged: best_val_acc - best_val_loss - ")
    last = r.stderr.strip().splitlines()[-1]  # (after the warning: lr outside the space)
    assert last.startswith("Error: the run diverged: loss is nan at epoch 1"), r.stderr
