"""The `hpsearch` package: its Python API loads what it needs on first use."""

from __future__ import annotations

import subprocess
import sys


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
