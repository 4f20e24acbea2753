"""The trainer: one function, `train`, that runs one trial of a study on one device.

It knows nothing of Optuna or MLflow: the search layer passes a `report` callback (pruning)
and an `on_epoch` hook (tracking). The data types import without torch; `train` and the
model helpers load torch on first use.
"""

from __future__ import annotations

from typing import Any

from hpsearch.trainer.types import (
    CheckpointError,
    EpochRecord,
    Report,
    TrainOptions,
    TrialResult,
    WarmCache,
)

_HEAVY = {
    "train": "hpsearch.trainer.trial",
    "evaluate_model": "hpsearch.trainer.trial",
    "load_trained_model": "hpsearch.trainer.trial",
    "build_model": "hpsearch.trainer.models",
}


def __getattr__(name: str) -> Any:
    if name in _HEAVY:
        import importlib

        return getattr(importlib.import_module(_HEAVY[name]), name)
    raise AttributeError(f"module 'hpsearch.trainer' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "EpochRecord",
    "Report",
    "TrainOptions",
    "TrialResult",
    "WarmCache",
    "build_model",
    "evaluate_model",
    "load_trained_model",
    "train",
]
