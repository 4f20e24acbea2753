"""CPU seconds per process role and per thread while a command runs: where the CPU that is
not training goes (on 2 cores that training fills, each such second costs about a second of
wall time).

Samples `/proc/<pid>/task/<tid>/stat` of the command's own processes every `--interval`
seconds: the command and its descendants, the PostgreSQL backends serving its database (the
database of a postgresql:// URL among its arguments, or `--database`), and any `--pid` given
(e.g. an MLflow server started before it) with their descendants. Other processes on the
machine (a CI, other users) are not counted. Each thread's CPU counts from the first sample
(threads older than the command, such as a `--pid` server's or a backend's, count only what
they used meanwhile). A thread's CPU after the last sample before it ends is missed: at most
`--interval` each. Python threads have no OS names, so when `py-spy` is on PATH the command
runs under `py-spy record --threads --subprocesses` at a low rate only to name them
(`--no-names` skips it; py-spy's own CPU shows as its own rows).

Example (one launch of the overhead bench's hpsearch side against a running MLflow server):
    python bench/threads.py --json /tmp/threads.json -- python -m hpsearch.cli launch \\
        --study tiny --trials 6 --set budget.max_epochs=2 --workers 1 --device cpu \\
        --storage postgresql://postgres@127.0.0.1:5432/prof --tracking-uri http://127.0.0.1:5055
(add `--pid <the MLflow server's pid>` before `--` to count the server too)
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

from common import (
    BenchError,
    check_output_path,
    classify,
    database_of,
    nonnegative_int,
    own_processes,
    parse_stat,
    positive_float,
    process_table,
    run_main,
)

PROC = Path("/proc")


def role(cmdline: str) -> str:
    """The process's part (`common.classify`), py-spy's own processes apart."""
    return "py-spy" if "py-spy" in cmdline else classify(cmdline)


Key = tuple[int, int, int]  # pid, tid, the thread's start time (ticks): tids are reused


def read_threads(pids: set[int], proc: Path = PROC) -> dict[Key, tuple[str, float]]:
    """(pid, tid, start) -> (command line, CPU seconds so far) of the threads of `pids`."""
    out: dict[Key, tuple[str, float]] = {}
    for pid in pids:
        try:
            raw = (proc / str(pid) / "cmdline").read_bytes()
            tids = os.listdir(proc / str(pid) / "task")
        except OSError:  # gone meanwhile
            continue
        cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        for tid in tids:
            try:
                _, start, cpu = parse_stat((proc / str(pid) / "task" / tid / "stat").read_text())
            except (OSError, IndexError, ValueError):
                continue
            out[(pid, int(tid), start)] = (cmd, cpu)
    return out


class Sampler:
    """Threads' CPU of the processes `roots` (themselves included) and their descendants,
    and of the PostgreSQL backends serving `databases`."""

    def __init__(
        self, interval_s: float, roots: list[int], databases: list[str], proc: Path = PROC
    ) -> None:
        self.interval_s = interval_s
        self.roots = list(roots)
        self.databases = databases
        self.proc = proc
        self.seen: set[int] = set()  # pids counted once: still counted when reparented
        self.base = {k: cpu for k, (_, cpu) in read_threads(self._pids(), proc).items()}
        self.last: dict[Key, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _pids(self) -> set[int]:
        table = process_table(self.proc)
        mine = own_processes(table, self.roots, self.databases)
        mine |= {pid for pid in self.roots if pid in table}
        self.seen = {pid for pid in self.seen if pid in table} | mine
        return self.seen

    def start(self, root: int) -> None:
        """Count `root` (the command, started after the base was read) and its descendants."""
        self.roots.append(root)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.last.update(read_threads(self._pids(), self.proc))
            self._stop.wait(self.interval_s)

    def stop(self) -> dict[Key, tuple[str, float]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.last.update(read_threads(self._pids(), self.proc))
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
    p.add_argument("--interval", type=positive_float, default=0.05, help="seconds between samples")
    p.add_argument("--top", type=nonnegative_int, default=25, help="threads shown")
    p.add_argument("--no-names", action="store_true", help="do not run under py-spy")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument(
        "--pid", type=int, action="append", default=[], metavar="PID",
        help="count this running process and its descendants too (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--database", action="append", default=[], metavar="NAME",
        help="count the PostgreSQL backends serving this database (repeatable; default: "
        "the database of a postgresql:// URL in the command)",
    )  # fmt: skip
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("give the command to run after --")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main("threads.py", lambda: bench(args))


def bench(args: argparse.Namespace) -> int:
    check_output_path(args.json)
    spy = None if args.no_names else shutil.which("py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "spy.txt"
        cmd = list(args.command)
        if spy:
            cmd = [spy, "record", "-r", "5", "--threads", "--subprocesses", "-f", "raw",
                   "-o", str(raw), "--", *cmd]  # fmt: skip
        databases = list(args.database) or [
            db for db in map(database_of, args.command) if db is not None
        ]
        sampler = Sampler(args.interval, list(args.pid), databases)
        t0 = time.perf_counter()
        try:
            child = subprocess.Popen(cmd)
        except OSError as exc:  # no such command, not executable
            raise BenchError(f"{args.command[0]}: cannot run: {exc.strerror}") from None
        sampler.start(child.pid)
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
