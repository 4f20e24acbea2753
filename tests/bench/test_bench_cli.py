"""The bench scripts' command lines: bad input is one line on stderr and a non-zero exit,
found before any work is done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from bench_helpers import BENCH, bench_module


def _parser(name: str) -> Callable[[list[str]], object]:
    module = bench_module(name)
    return module.main if name == "tracking" else module.parse_args


# Counts and durations that used to be accepted (storage.py --seconds 0 then ran forever in
# hpsearch mode: a worker's timeout_s=0 is "no limit"; the others ran a row of zeros).
BAD = [
    ("storage", ["--seconds", "0"]),
    ("storage", ["--seconds", "-5"]),
    ("storage", ["--workers", "0"]),
    ("storage", ["--workers", "1", "-2"]),
    ("storage", ["--epochs", "0"]),
    ("storage", ["--epoch-s", "-1"]),
    ("packing", ["--launch-timeout", "-5"]),
    ("packing", ["--launch-timeout", "0"]),
    ("packing", ["--epochs", "0"]),
    ("packing", ["--gpu-interval", "0"]),
    ("study", ["--timeout", "0"]),
    ("study", ["--grace", "-1"]),
    ("study", ["--trials", "0"]),
    ("overhead", ["--workers", "0"]),
    ("overhead", ["--side-timeout", "nan"]),
    ("trainer", ["--steps", "0"]),
    ("trainer", ["--batch", "0"]),
    ("trainer", ["--resolution", "-1"]),
    ("trainer", ["--warmup", "-1"]),
    ("tracking", ["--trials", "0"]),
    ("tracking", ["--epochs", "0"]),
    ("threads", ["--interval", "0", "--", "true"]),
]


@pytest.mark.parametrize(("script", "argv"), BAD, ids=[f"{s} {' '.join(a)}" for s, a in BAD])
def test_bad_counts_and_durations_are_refused_at_parse_time(
    script: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser(script)(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {argv[0]}: {argv[-1] if script != 'threads' else argv[1]!r}" in err


def test_good_counts_and_durations_pass() -> None:
    args = _parser("storage")(["--workers", "1", "8", "--seconds", "0.5", "--epoch-s", "0"])
    assert args.workers == [1, 8] and args.seconds == 0.5 and args.epoch_s == 0.0


def _one_line_error(err: str, script: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"bench/{script}: error: "), lines[0]
    return lines[0]


def test_trainer_refuses_a_batch_larger_than_the_training_split(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before, `fast_batches` looped forever: `range(10 // 16)` is empty inside `while True`."""
    import numpy as np
    import torch

    trainer = bench_module("trainer")
    common = sys.modules["common"]

    class Dec:
        images = np.zeros((10, 8, 8, 3), dtype=np.uint8)
        labels = np.zeros(10, dtype=np.int64)
        built = False

    monkeypatch.setattr(trainer.data, "get_source", lambda cfg, split: object())
    monkeypatch.setattr(trainer.data, "load_or_build_cache", lambda *a, **k: Dec())
    args = trainer.parse_args(["--batch", "16", "--resolution", "8", "--workdir", str(tmp_path)])
    with pytest.raises(common.BenchError, match=r"--batch: 16: larger than the training split"):
        next(trainer.fast_batches(args, torch.device("cpu"), {}))
    args = trainer.parse_args(["--batch", "10", "--resolution", "8", "--workdir", str(tmp_path)])
    x, _ = next(trainer.fast_batches(args, torch.device("cpu"), {}))
    assert x.shape[0] == 10


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--modes", "fast", "--data-dir", "/nonexistent"], "/nonexistent"),
        (["--modes", "classic", "--data-dir", "/nonexistent"], "/nonexistent"),
        (["--modes", "bogus"], "--modes: 'bogus'"),
        (["--modes", "synthetic", "--json", "/nonexistent/r.json"], "--json: /nonexistent/r.json"),
    ],
)
def test_trainer_bad_input_is_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trainer = bench_module("trainer")
    argv = [*argv, "--device", "cpu", "--workdir", str(tmp_path), "--steps", "1", "--warmup", "0"]
    assert trainer.main(argv) == 2
    assert says in _one_line_error(capsys.readouterr().err, "trainer.py")


def test_trainer_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert bench_module("trainer").main(["--device", "cuda", "--modes", "synthetic"]) == 2
    assert "CUDA" in _one_line_error(capsys.readouterr().err, "trainer.py")


PG = os.environ.get("HPSEARCH_BENCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432")


def _pg_databases(prefix: str) -> list[str] | None:
    """The databases named PREFIX*, or None when PostgreSQL is not reachable."""
    try:
        import psycopg2

        conn = psycopg2.connect(f"{PG}/postgres", connect_timeout=3)
    except Exception:
        return None
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", (prefix + "%",))
            return [row[0] for row in cur.fetchall()]
    finally:
        conn.close()


@pytest.mark.skipif(_pg_databases("") is None, reason=f"needs PostgreSQL at {PG}")
def test_storage_cleans_up_on_sigterm(tmp_path: Path) -> None:
    """`timeout 10 storage.py ...` left its database and temp folder behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "storage.py"), "--pg", PG, "--workers", "2",
         "--seconds", "60", "--modes", "hpsearch"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    db = f"hpsearch_bench_storage_{proc.pid}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (_pg_databases(db) and any(tmp.iterdir())):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        time.sleep(2.0)  # the workers running
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert err.strip() == "bench/storage.py: interrupted"
    assert _pg_databases(db) == []
    assert list(tmp.iterdir()) == []


def test_tracking_writes_strict_json_and_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its JSON had NaN (the `none` mode has no delivery latencies), which strict parsers
    refuse; without --json it wrote bench-tracking.json into the current folder unasked."""
    import json

    tracking = bench_module("tracking")
    common = sys.modules["common"]
    assert tracking.parse_args([]).json is None
    out = tmp_path / "t.json"
    common.write_json(out, {"latency": tracking.summary_ms([]), "n": [1.5, float("inf")]})

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    record = json.loads(out.read_text(), parse_constant=refuse)
    assert record["latency"]["p50"] is None and record["n"] == [1.5, None]
    # an unwritable --json is found before the MLflow server starts, not after the run
    assert tracking.main(["--json", str(tmp_path / "no" / "t.json")]) == 2
    assert "--json" in _one_line_error(capsys.readouterr().err, "tracking.py")


def test_stored_results_are_strict_json() -> None:
    import json

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    for path in sorted((BENCH / "results").glob("*.json")):
        json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("overhead", ["--study", "tiny", "--device", "cpu"]),
        ("packing", ["--device", "cpu"]),
        ("study", ["--device", "cpu"]),
        ("storage", ["--workers", "1"]),
        ("trainer", ["--device", "cpu"]),
        ("threads", ["--no-names"]),
    ],
)
def test_an_unwritable_json_path_is_refused_before_any_work(
    script: str, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found only at the end before, as a FileNotFoundError traceback after minutes of work."""
    bad = str(tmp_path / "missing" / "r.json")
    full = [*argv, "--json", bad] + (["--", "true"] if script == "threads" else [])
    assert bench_module(script).main(full) == 2
    err = capsys.readouterr().err
    assert f"--json: {bad}: no such folder" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1


def test_threads_with_a_command_that_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_module("threads").main(["--no-names", "--", "/nonexistent/cmd"]) == 2
    line = _one_line_error(capsys.readouterr().err, "threads.py")
    assert "/nonexistent/cmd: cannot run: No such file or directory" in line
