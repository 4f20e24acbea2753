"""Running the real `hpsearch` CLI in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

DUMMY = "dummy_trainer:train"


def hpsearch(
    args: Sequence[str], env: dict[str, str], timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpsearch.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def popen(args: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    fh = open(log, "wb")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "hpsearch.cli", *args], env=env, stdout=fh, stderr=subprocess.STDOUT
    )


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
