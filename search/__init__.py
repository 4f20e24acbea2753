"""hpsearch: hyperparameter search for image classifiers on 1-8 GPUs.

Optuna studies in PostgreSQL (or a journal file), pruned torchvision trials in worker
processes, everything in MLflow.

    import hpsearch
    url = "postgresql://postgres@127.0.0.1/test"
    study = hpsearch.load_study("flowers102", storage=url)
    top = hpsearch.best_trials("flowers102", storage=url, k=5)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from hpsearch.config import StudyConfig, load_config
from hpsearch.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DatasetError,
    DeviceError,
    DiskFullError,
    HpsearchError,
    HpsearchWarning,
    StorageError,
    StudyNotFoundError,
    TrackingError,
    TrackingUnreachable,
)

if TYPE_CHECKING:
    from hpsearch.query import (
        best_trials,
        enqueue_trial,
        list_studies,
        load_best_model,
        load_study,
        study_status,
    )

# The query functions load on first use: they need pandas and Optuna (about 0.5 s of
# imports), which a worker's plot helper and `hpsearch --help` do not.
_LAZY = (
    "best_trials",
    "enqueue_trial",
    "list_studies",
    "load_best_model",
    "load_study",
    "study_status",
)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hpsearch' has no attribute {name!r}")
    value = getattr(importlib.import_module("hpsearch.query"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The lazy functions too: `dir(hpsearch)` and tab completion listed none of them."""
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DatasetError",
    "DeviceError",
    "DiskFullError",
    "HpsearchError",
    "HpsearchWarning",
    "StorageError",
    "StudyConfig",
    "StudyNotFoundError",
    "TrackingError",
    "TrackingUnreachable",
    "__version__",
    "best_trials",
    "enqueue_trial",
    "list_studies",
    "load_best_model",
    "load_config",
    "load_study",
    "study_status",
]
