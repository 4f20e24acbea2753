"""Helpers for the trainer tests (a uniquely named module: tests/ has no packages)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpsearch.config import StudyConfig, validate_config

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(os.environ.get("HPSEARCH_DATA_DIR", REPO.parent / "shared" / "datasets"))


def make_config(dataset: dict[str, Any], **sections: Any) -> StudyConfig:
    raw: dict[str, Any] = {"name": "test", "dataset": dataset}
    raw.update(sections)
    return validate_config(raw)


def synthetic(**overrides: Any) -> StudyConfig:
    """Tiny synthetic study: 16 px, 48 train / 32 val images, 10 classes, 2 epochs."""
    dataset = {"name": "synthetic", "image_size": 16, "train_limit": 48, "eval_limit": 32}
    dataset.update(overrides.pop("dataset", {}))
    sections = {"budget": {"max_epochs": 2}, "trainer": {"evaluate_test": False}}
    sections.update(overrides)
    return make_config(dataset, **sections)
