"""Loading a bench script as a module, for the bench tests."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """`bench/NAME.py` as its script sees it (`bench/` on sys.path, `common` importable),
    under a name of its own: `trainer` and `tracking` are also test packages here."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    key = f"hpsearch_bench_script_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        path = list(sys.path)
        try:
            spec.loader.exec_module(module)
        finally:  # storage.py puts the repository first: `tracking` would be its package
            sys.path[:] = path
    return sys.modules[key]


def ready_child(overhead: ModuleType, child: str, folder: Path) -> Any:
    """overhead.py's `Proc` of a Python child given as code, once it printed its first
    line (its signal handlers are set by then): at most 30 s."""
    proc = overhead.Proc.start(
        [sys.executable, "-c", child], dict(os.environ), folder, folder / "child.log"
    )
    deadline = time.monotonic() + 30
    while not proc.lines and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc
