"""Experiment tracking: the local MLflow server, per-trial MLflow runs, GPU telemetry and
artifacts (plots, ONNX, CSV).

Telemetry is best-effort: nothing in this package raises into a training loop because the
tracking server is slow or down; it logs a warning on the ``hpsearch.tracking`` logger instead.
Only starting a server that was explicitly asked for (and export verification) raises
:class:`hpsearch.errors.TrackingError`.

Import the submodules directly (``hpsearch.tracking.server``, ``.mlflow_logger``, ``.gpu``,
``.artifacts``); this package module stays import-light on purpose.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("hpsearch.tracking")

__all__ = ["logger"]
