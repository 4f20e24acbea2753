"""The library's exceptions. The CLI turns each into one line and a non-zero exit."""

from __future__ import annotations


class HpsearchError(Exception):
    """Base class: everything hpsearch raises on purpose."""


class ConfigError(HpsearchError):
    """A study file, an override or a CLI value breaks a rule."""


class StorageError(HpsearchError):
    """The Optuna storage URL is bad or the database cannot be reached."""


class DataError(HpsearchError):
    """The dataset is missing, has the wrong layout or cannot be downloaded."""


class DatasetError(DataError):
    """The study's dataset itself is wrong (missing, a layout, a file that does not decode
    under on_corrupt: fail, classes changed): every trial would fail on it alike, so a
    worker stops at the first (EXIT_DATA_ERROR). A trial's own data problem (one arch's
    pretrained weights) is a plain DataError: the trial fails, the search goes on."""


class DeviceError(HpsearchError):
    """The requested device or GPUs are not available."""


class TrackingError(HpsearchError):
    """The MLflow server could not be started or reached when it was required."""


class TrackingUnreachable(TrackingError):
    """The MLflow server did not answer in time; a later try may reach it."""


class HpsearchWarning(UserWarning):
    """It works, but not as asked (a study file's option Optuna deprecated, fp16 asked on a
    CPU): the CLI shows it as one line, `warning: ...`."""


class StudyNotFoundError(HpsearchError):
    """The named study does not exist in the storage."""


class CheckpointError(HpsearchError):
    """A checkpoint could not be written (disk full, permissions) or belongs to other
    hyperparameters; the previous checkpoint is intact."""


class DiskFullError(CheckpointError):
    """The work folder's disk has no room for a trial's checkpoints: a worker stops before it
    asks for one, and a restart would stop the same way until room is made. `need_bytes`:
    the size of the file a trial could not write, where known."""

    def __init__(self, message: str, need_bytes: int | None = None) -> None:
        super().__init__(message)
        self.need_bytes = need_bytes


# The exit code of a worker stopped by DiskFullError (sysexits' EX_IOERR); the launcher
# restarts it only once the disk has room: each restart failed the same way, a dozen times
# over a launch's workers.
EXIT_DISK_FULL = 74

# The exit code of a worker stopped by a DatasetError (sysexits' EX_DATAERR): the data
# is the same for every trial and every restart (a corrupt image under on_corrupt: fail
# failed each trial, three in a row per worker and three restarts: twelve on two workers).
# The launcher does not restart it.
EXIT_DATA_ERROR = 65

# The exit code of a worker whose --train-fn does not load (sysexits' EX_CONFIG): a module
# found before the launch whose function is misspelled, or whose import raises, fails the
# same way after each restart. The launcher does not restart it.
EXIT_CONFIG = 78
