"""Reading studies back: the Python API and the `status`, `best` and `studies` commands."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
from hpsearch.errors import HpsearchError, StudyNotFoundError
from hpsearch.storage import StorageSpec, open_storage, resolve_storage
from hpsearch.study import CONFIG_ATTR
from optuna.trial import FrozenTrial, TrialState

USER_COLUMNS = ("outcome", "worker", "host", "test_acc", "mlflow_run_id")


def default_workdir() -> Path:
    return Path(os.environ.get("HPSEARCH_WORKDIR", ".hpsearch"))


def _spec(storage: str | None, workdir: Path | None) -> StorageSpec:
    return resolve_storage(storage, workdir or default_workdir())


def load_study(name: str, storage: str | None = None, workdir: Path | None = None) -> optuna.Study:
    """The `optuna.Study` named `name` (storage: URL, else HPSEARCH_STORAGE, else the journal)."""
    spec = _spec(storage, workdir)
    if spec.kind == "journal" and not Path(spec.url).exists():
        raise StudyNotFoundError(f"study {name!r} not found: no journal at {spec.url}")
    st = open_storage(spec, pool_size=1)
    try:
        return optuna.load_study(study_name=name, storage=st)
    except KeyError as exc:
        raise StudyNotFoundError(f"study {name!r} not found in {spec.display}") from exc


def _ranked(study: optuna.Study) -> list[FrozenTrial]:
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(study.directions) > 1:
        return list(study.best_trials)
    reverse = study.direction == optuna.study.StudyDirection.MAXIMIZE
    return sorted(done, key=lambda t: t.value if t.value is not None else 0.0, reverse=reverse)


def checkpoint_uri(trial: FrozenTrial) -> str | None:
    uri = trial.user_attrs.get("checkpoint_uri") or trial.user_attrs.get("best_model")
    return str(uri) if uri else None


def trial_row(t: FrozenTrial) -> dict[str, Any]:
    row: dict[str, Any] = {
        "number": t.number,
        "value": t.value if t.values is None or len(t.values) == 1 else list(t.values),
        "state": t.state.name,
    }
    for k, v in t.params.items():
        row[f"params_{k}"] = v
    row["datetime_start"] = t.datetime_start
    row["duration_s"] = (
        (t.datetime_complete - t.datetime_start).total_seconds()
        if t.datetime_complete and t.datetime_start
        else None
    )
    for k in USER_COLUMNS:
        row[k] = t.user_attrs.get(k)
    row["checkpoint_uri"] = checkpoint_uri(t)
    return row


def best_trials(
    name: str, storage: str | None = None, k: int = 5, workdir: Path | None = None
) -> pd.DataFrame:
    """The top-k completed trials, best first: number, value, state, one `params_<name>` column
    per parameter, start and duration, and user attributes including `mlflow_run_id`."""
    if k < 1:
        raise HpsearchError(f"k: {k}: must be at least 1")
    study = load_study(name, storage, workdir)
    rows = [trial_row(t) for t in _ranked(study)[:k]]
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class StudyStatus:
    name: str
    counts: dict[str, int]
    best: dict[str, Any] | None
    running: list[dict[str, Any]]
    storage: str
    startup_s_median: float | None = None  # per-trial start-up: ask to first training step


def study_status(name: str, storage: str | None = None, workdir: Path | None = None) -> StudyStatus:
    spec = _spec(storage, workdir)
    study = load_study(name, storage, workdir)
    trials = study.get_trials(deepcopy=False)
    counts = {s.name.lower(): 0 for s in TrialState}
    for t in trials:
        counts[t.state.name.lower()] += 1
    ranked = _ranked(study)
    best = trial_row(ranked[0]) if ranked else None
    running = [
        {
            "number": t.number,
            "worker": t.user_attrs.get("worker"),
            "host": t.user_attrs.get("host"),
            "last_epoch": max(t.intermediate_values) if t.intermediate_values else None,
        }
        for t in trials
        if t.state == TrialState.RUNNING
    ]
    startups = sorted(
        float(t.user_attrs["startup_s"]) for t in trials if "startup_s" in t.user_attrs
    )
    median = startups[len(startups) // 2] if startups else None
    return StudyStatus(name, counts, best, running, spec.display, median)


def list_studies(storage: str | None = None, workdir: Path | None = None) -> list[dict[str, Any]]:
    spec = _spec(storage, workdir)
    if spec.kind == "journal" and not Path(spec.url).exists():
        return []
    st = open_storage(spec, pool_size=1)
    out = []
    for s in optuna.get_all_study_summaries(st, include_best_trial=True):
        best = s.best_trial
        out.append(
            {
                "name": s.study_name,
                "n_trials": s.n_trials,
                "directions": [d.name.lower() for d in s.directions],
                "best_value": best.value if best is not None and len(s.directions) == 1 else None,
                "best_trial": best.number if best is not None else None,
            }
        )
    return out


def load_best_model(
    name: str,
    storage: str | None = None,
    tracking_uri: str | None = None,
    workdir: Path | None = None,
    device: str = "cpu",
) -> Any:
    """The torch model of the best trial, in eval mode.

    Weights come from the trial's best-model file when it is on this machine, else from the
    checkpoint logged to MLflow (`tracking_uri`, MLFLOW_TRACKING_URI).
    """
    import yaml
    from hpsearch.config import validate_config
    from hpsearch.trainer import load_trained_model

    study = load_study(name, storage, workdir)
    ranked = _ranked(study)
    if not ranked:
        raise HpsearchError(f"study {name!r} has no completed trial yet")
    best = ranked[0]
    raw_cfg = study.user_attrs.get(CONFIG_ATTR)
    if not raw_cfg:
        raise HpsearchError(f"study {name!r} has no stored config; was it created by hpsearch?")
    cfg = validate_config(yaml.safe_load(raw_cfg), f"study {name}")
    path = best.user_attrs.get("best_model")
    if not path or not Path(str(path)).exists():  # another host's trial: from MLflow
        from hpsearch.runs import download_best_model

        path = download_best_model(best, tracking_uri, workdir or default_workdir())
    return load_trained_model(cfg, best.params, Path(str(path)), device=device)
