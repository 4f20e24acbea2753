"""hpsearch: hyperparameter search for image classifiers on 1-8 GPUs.

Optuna studies in PostgreSQL (or a journal file), pruned torchvision trials in worker
processes, everything in MLflow.

    import hpsearch
    study = hpsearch.load_study("flowers102", storage="postgresql://postgres@127.0.0.1/test")
    top = hpsearch.best_trials("flowers102", k=5)
"""

from __future__ import annotations

__version__ = "0.1.0"

from hpsearch.config import StudyConfig, load_config
from hpsearch.errors import (
    ConfigError,
    DataError,
    DeviceError,
    HpsearchError,
    StorageError,
    StudyNotFoundError,
    TrackingError,
)
from hpsearch.query import best_trials, list_studies, load_best_model, load_study, study_status

__all__ = [
    "ConfigError",
    "DataError",
    "DeviceError",
    "HpsearchError",
    "StorageError",
    "StudyConfig",
    "StudyNotFoundError",
    "TrackingError",
    "__version__",
    "best_trials",
    "list_studies",
    "load_best_model",
    "load_config",
    "load_study",
    "study_status",
]
