"""`bench/threads.py`: the per-thread CPU figures in docs/performance.md come from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_a_busy_thread_of_a_watched_process_is_counted(tmp_path: Path) -> None:
    """A watched process (its command line names hpsearch) spinning one thread for ~0.6 s
    shows about that CPU time on that thread."""
    busy = (
        "import threading, time  # hpsearch\n"
        "def spin():\n"
        "    end = time.process_time() + 0.6\n"
        "    while time.process_time() < end: pass\n"
        "t = threading.Thread(target=spin); t.start(); t.join()\n"
    )
    out = tmp_path / "t.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "threads.py"), "--no-names", "--json", str(out), "--",
         sys.executable, "-c", busy],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    mine = [t for t in result["threads"] if t["pid"] == result["command_pid"]]
    spun = [t for t in mine if t["tid"] != t["pid"]]
    assert len(spun) == 1 and 0.4 <= spun[0]["cpu_s"] <= 1.0
    assert "top threads" in proc.stdout


def test_processes_outside_the_command_are_not_counted(tmp_path: Path) -> None:
    """A busy process on the machine whose command line names hpsearch, but that the command
    did not start, is left out (before, `threads.py -- sleep 8` showed a CI's launcher and
    MLflow server)."""
    busy = "import time  # hpsearch.cli launch\nwhile True: time.process_time()\n"
    other = subprocess.Popen([sys.executable, "-c", busy])
    try:
        out = tmp_path / "t.json"
        proc = subprocess.run(
            [sys.executable, str(BENCH / "threads.py"), "--no-names", "--json", str(out), "--",
             sys.executable, "-c", "import time; time.sleep(1.0)"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        other.kill()
        other.wait()
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert {t["pid"] for t in result["threads"]} == {result["command_pid"]}
    assert "launcher" not in result["roles"]
