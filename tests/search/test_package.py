"""The `hpsearch` package: its Python API loads what it needs on first use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_package_loads_the_query_api_on_first_use() -> None:
    # A worker's plot helper and `hpsearch --help` import the package; pandas and Optuna's
    # storage (about 0.5 s) wait until the query API is used.
    code = (
        "import sys, hpsearch, hpsearch.cli\n"
        "assert 'pandas' not in sys.modules and 'hpsearch.query' not in sys.modules\n"
        "from hpsearch import best_trials, load_study\n"
        "assert callable(best_trials) and hpsearch.load_study is load_study\n"
        "assert 'pandas' in sys.modules\n"
        "try:\n"
        "    hpsearch.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_workers_onnx_export_does_not_load_matplotlib(tmp_path: Path) -> None:
    # A worker exports each new study best right after its tell; the plots are drawn in
    # the helper process, so matplotlib (0.3 s of CPU) has no business in the worker.
    code = (
        "import sys, torch\n"
        "from hpsearch.tracking.onnx_export import export_onnx\n"
        f"export_onnx(torch.nn.Linear(4, 3), torch.randn(2, 4), {str(tmp_path)!r} + '/m.onnx')\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
