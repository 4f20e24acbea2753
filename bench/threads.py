"""CPU seconds per process role and per thread while a command runs: where the CPU that is
not training goes (on 2 cores that training fills, each such second costs about a second of
wall time).

Samples `/proc/<pid>/task/<tid>/stat` of every process whose command line names hpsearch,
mlflow, a multiprocessing helper or postgres, every `--interval` seconds, and counts each
thread's CPU from the first sample (threads older than the command, such as an MLflow
server's, count only what they used meanwhile). A thread's CPU after the last sample before
it ends is missed: at most `--interval` each. Python threads have no OS names, so when
`py-spy` is on PATH the command runs under `py-spy record --threads --subprocesses` at a low
rate only to name them (`--no-names` skips it; py-spy's own CPU shows as its own rows).

Example (one launch of the overhead bench's hpsearch side against a running MLflow server):
    python bench/threads.py --json /tmp/threads.json -- python -m hpsearch.cli launch \\
        --study tiny --trials 6 --set budget.max_epochs=2 --workers 1 --device cpu \\
        --storage postgresql://postgres@127.0.0.1:5432/prof --tracking-uri http://127.0.0.1:5055
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import classify

WATCHED = ("hpsearch", "mlflow", "multiprocessing", "postgres")
TICK = os.sysconf("SC_CLK_TCK")


def role(cmdline: str) -> str:
    """The process's part (`common.classify`), py-spy's own processes apart."""
    return "py-spy" if "py-spy" in cmdline else classify(cmdline)


Key = tuple[int, int, int]  # pid, tid, the thread's start time (ticks): tids are reused


def read_threads() -> dict[Key, tuple[str, float]]:
    """(pid, tid, start) -> (command line, CPU seconds so far) of the watched processes."""
    out: dict[Key, tuple[str, float]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone meanwhile
            continue
        cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        if int(pid) == os.getpid() or not any(w in cmd for w in WATCHED):
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            key = (int(pid), int(tid), int(fields[19]))
            out[key] = (cmd, (int(fields[11]) + int(fields[12])) / TICK)
    return out


class Sampler:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.base = {k: cpu for k, (_, cpu) in read_threads().items()}  # before the command
        self.last: dict[Key, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.last.update(read_threads())
            self._stop.wait(self.interval_s)

    def stop(self) -> dict[Key, tuple[str, float]]:
        self._stop.set()
        self._thread.join()
        self.last.update(read_threads())
        return {k: (cmd, cpu - self.base.get(k, 0.0)) for k, (cmd, cpu) in self.last.items()}


def thread_names(raw_path: Path) -> dict[int, str]:
    """tid -> Python thread name, from py-spy's raw output ("thread (tid): name")."""
    names: dict[int, str] = {}
    if raw_path.is_file():
        for match in re.finditer(r"thread \((\d+)\): ([^;]+)", raw_path.read_text()):
            names[int(match.group(1))] = match.group(2).strip()
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    p.add_argument("--top", type=int, default=25, help="threads shown")
    p.add_argument("--no-names", action="store_true", help="do not run under py-spy")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("give the command to run after --")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spy = None if args.no_names else shutil.which("py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "spy.txt"
        cmd = list(args.command)
        if spy:
            cmd = [spy, "record", "-r", "5", "--threads", "--subprocesses", "-f", "raw",
                   "-o", str(raw), "--", *cmd]  # fmt: skip
        sampler = Sampler(args.interval)
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd)
        code = child.wait()
        wall = time.perf_counter() - t0
        used = sampler.stop()
        names = thread_names(raw)
    roles: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    for (pid, tid, _), (cmdline, cpu) in used.items():
        r = role(cmdline)
        roles[r] = roles.get(r, 0.0) + cpu
        name = names.get(tid, "main" if tid == pid else "(native)" if names else "?")
        rows.append({"role": r, "pid": pid, "tid": tid, "thread": name, "cpu_s": round(cpu, 2)})
    rows.sort(key=lambda row: -row["cpu_s"])
    print(f"exit {code}, wall {wall:.1f} s; CPU s by role:")
    by_cpu = sorted(roles.items(), key=lambda item: -item[1])
    for r, cpu in by_cpu:
        print(f"  {r:14} {cpu:7.2f}")
    print(f"top threads (CPU s, role, thread, tid){'' if names else ' (no names: no py-spy)'}:")
    for row in rows[: args.top]:
        if row["cpu_s"] >= 0.01:
            print(f"  {row['cpu_s']:7.2f}  {row['role']:14} {row['thread']:40} {row['tid']}")
    if args.json:
        out = {
            "command": [sys.executable, *sys.argv],
            "exit": code,
            "command_pid": child.pid,  # py-spy's, when it names the threads
            "wall_s": round(wall, 2),
            "roles": {r: round(c, 2) for r, c in by_cpu},
            "threads": rows,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"JSON: {args.json}")
    return code


if __name__ == "__main__":
    sys.exit(main())
