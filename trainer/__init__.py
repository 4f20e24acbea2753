"""The trainer: one function, `train`, that runs one trial of a study on one device.

It knows nothing of Optuna or MLflow: the search layer passes a `report` callback (pruning)
and an `on_epoch` hook (tracking).
"""

from hpsearch.trainer.models import build_model
from hpsearch.trainer.trial import (
    CheckpointError,
    EpochRecord,
    Report,
    TrainOptions,
    TrialResult,
    WarmCache,
    evaluate_model,
    load_trained_model,
    train,
)

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
