"""Real small disks for the full- and read-only-disk tests: a tmpfs mounted on a folder."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(folder: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of `size` ("24M") on `folder` (made here), unmounted afterwards. Mounting
    needs root, as CI has; elsewhere the test is skipped."""
    folder.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs mount here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def remount(folder: Path, mode: str) -> None:
    """`mode`: "ro" or "rw"."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(folder)], check=True)
