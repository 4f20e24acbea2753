"""Reading studies back: the Python API and the `status`, `best` and `studies` commands."""

from __future__ import annotations

import contextlib
import operator
import os
import socket
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import pandas as pd
import sqlalchemy as sa
from hpsearch.errors import ConfigError, HpsearchError, StorageError, StudyNotFoundError
from hpsearch.reporting import ATTR_LAST_EPOCH
from hpsearch.storage import (
    StorageSpec,
    has_optuna_tables,
    open_storage,
    refresh_trials_now,
    resolve_storage,
    storage_file,
    study_lock,
    with_db_retry,
)
from hpsearch.study import (
    CONFIG_ATTR,
    LATE_RUN_ATTR,
    N_TRIALS_ATTR,
    budget_room,
    budget_used,
    holding_trial,
    pareto_front,
    rank_key,
    study_budget,
    trial_config_yaml,
)
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.exc import SQLAlchemyError

if TYPE_CHECKING:
    import torch

USER_COLUMNS = ("outcome", "worker", "host", "test_acc", "mlflow_run_id")


# What the API takes for `storage` and `workdir`: a notebook passes strings and paths alike.
StorageArg = str | os.PathLike[str] | None
WorkdirArg = str | os.PathLike[str] | None


def default_workdir() -> Path:
    # An empty HPSEARCH_WORKDIR is unset, as for the CLI (click reads it so).
    return Path(os.environ.get("HPSEARCH_WORKDIR") or ".hpsearch")


def _workdir(workdir: WorkdirArg) -> Path:
    return Path(workdir) if workdir else default_workdir()


def _spec(storage: StorageArg, workdir: WorkdirArg) -> StorageSpec:
    if storage is not None and not isinstance(storage, str | os.PathLike):
        raise StorageError(
            f"storage: {type(storage).__name__}: expected a storage URL or a journal file's "
            "path (an Optuna storage object: optuna.load_study(storage=...) reads it directly)"
        )
    return resolve_storage(
        os.fspath(storage) if storage else None, _workdir(workdir), given_as="storage"
    )


def missing_file(spec: StorageSpec, storage: StorageArg) -> StorageError | None:
    """A SQLite or journal file named (storage=, HPSEARCH_STORAGE) that is not there: a
    mistyped path, not an empty store (the work folder's own journal is made by its first
    launch)."""
    given = bool(storage or os.environ.get("HPSEARCH_STORAGE"))
    file = storage_file(spec)
    if given and file is not None and not file.exists():
        return StorageError(f"storage {spec.display}: no such file")
    return None


def _open(name: str, storage: StorageArg, workdir: WorkdirArg) -> tuple[optuna.Study, Any]:
    """The study and the storage it reads, whose connections the caller disposes of."""
    if not isinstance(name, str) or not name:  # Optuna loads a store's only study for None
        raise StudyNotFoundError(f"study name: {name!r}: must be a non-empty string")
    spec = _spec(storage, workdir)
    if (missing := missing_file(spec, storage)) is not None:
        raise missing
    if spec.kind == "journal" and not Path(spec.url).exists():
        raise StudyNotFoundError(f"study {name!r} not found: no journal at {spec.url}")
    if spec.kind == "rdb" and not has_optuna_tables(spec):  # none made in a mistyped database
        raise StudyNotFoundError(f"study {name!r} not found: no Optuna tables in {spec.display}")
    st = open_storage(spec, pool_size=1, create=False)
    try:
        return optuna.load_study(study_name=name, storage=st), st
    except KeyError as exc:
        names: list[str] = []
        try:  # the studies there, as `launch --study` lists the study files it knows
            names = sorted(s.study_name for s in st.get_all_studies())
        except (optuna.exceptions.OptunaError, SQLAlchemyError, OSError):
            pass  # the name not found is what to say
        finally:
            _dispose(st)
        here = f"; studies here: {', '.join(names[:20])}" if names else "; it holds no study"
        raise StudyNotFoundError(f"study {name!r} not found in {spec.display}{here}") from exc
    except BaseException:
        _dispose(st)
        raise


def _dispose(storage: Any) -> None:
    """Close a storage's pooled connections now: each call here made its own engine, and a
    notebook or dashboard polling `study_status` would otherwise hold a growing number of
    PostgreSQL connections until the garbage collector ran."""
    engine = getattr(storage, "engine", None)
    if engine is not None:
        engine.dispose()


@contextlib.contextmanager
def reading_study(
    name: str, storage: StorageArg = None, workdir: WorkdirArg = None
) -> Iterator[optuna.Study]:
    """`load_study` for a read: its storage's connections are closed on leaving."""
    study, st = _open(name, storage, workdir)
    try:
        yield study
    finally:
        _dispose(st)


def load_study(name: str, storage: StorageArg = None, workdir: WorkdirArg = None) -> optuna.Study:
    """The `optuna.Study` named `name` (storage: URL, else HPSEARCH_STORAGE, else the journal).
    Its storage stays open for the study's use: a database's pooled connection closes when
    the study is garbage-collected (the other readers close theirs before they return)."""
    return _open(name, storage, workdir)[0]


def _ranked(study: optuna.Study) -> list[FrozenTrial]:
    """Completed trials, best first (ties: the earlier trial). A multi-objective study has
    no single best: its Pareto front, ordered by the first objective."""
    if len(study.directions) > 1:
        front = list(study.best_trials)
        sign = 1.0 if study.directions[0] == optuna.study.StudyDirection.MINIMIZE else -1.0
        return sorted(front, key=lambda t: (sign * t.values[0], t.number))
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return sorted(done, key=rank_key(study.direction))


def checkpoint_uri(trial: FrozenTrial, workdir: Path | None = None) -> str | None:
    """The best model logged to MLflow, else the trial's best-model file: None once that
    file is deleted (outside the top tracking.keep_top_k since), as seen on the host that
    ran the trial (another host's file is not seen from here). A file not where it was
    written is looked for under `workdir` (a work folder moved, or mounted elsewhere)."""
    uri = trial.user_attrs.get("checkpoint_uri")
    if uri:
        return str(uri)
    local = trial.user_attrs.get("best_model")
    if not local:
        return None
    path = Path(str(local))
    here = trial.user_attrs.get("host") in (None, socket.gethostname())
    if here and path.is_absolute() and not path.exists():
        moved = _under_workdir(path, workdir) if workdir is not None else None
        return str(moved) if moved is not None else None
    return str(local)


def _under_workdir(path: Path, workdir: Path) -> Path | None:
    """`path` (`.../checkpoints/<study>/<file>`) under `workdir` instead, when it is there."""
    parts = path.parts
    if len(parts) < 3 or parts[-3] != "checkpoints":
        return None
    under = workdir.joinpath(*parts[-3:])
    return under if under.is_file() else None


def trial_row(
    t: FrozenTrial, study_attrs: Mapping[str, Any] | None = None, workdir: Path | None = None
) -> dict[str, Any]:
    """One trial's columns (`FIXED_COLUMNS` and its params). `study_attrs`: its study's user
    attributes, which link the MLflow run made after a trial had ended (`LATE_RUN_ATTR`);
    `workdir`: where its best-model file is looked for when not where it was written."""
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
    if not row["mlflow_run_id"] and study_attrs:  # a retry's is "" until it links its own
        row["mlflow_run_id"] = study_attrs.get(LATE_RUN_ATTR.format(number=t.number)) or None
    row["checkpoint_uri"] = checkpoint_uri(t, workdir)
    return row


FIXED_COLUMNS = ("number", "value", "state", "datetime_start", "duration_s", *USER_COLUMNS,
                 "checkpoint_uri")  # fmt: skip


def top_trials(
    name: str, storage: StorageArg = None, k: int = 5, workdir: WorkdirArg = None
) -> list[dict[str, Any]]:
    """`best_trials` as rows (`trial_row`), each with only its own trial's parameters."""
    k = _count(k, "k")
    with reading_study(name, storage, workdir) as study:
        return _top_rows(study, k, _workdir(workdir))


def _count(value: object, name: str) -> int:
    """`value` (the argument `name`) as an int, at least 1 (numpy's integers too); a bool, a
    float or text is refused."""
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        n = 0
    if isinstance(value, bool) or n < 1:
        raise ConfigError(f"{name}: {value!r}: must be a whole number, at least 1")
    return n


def _top_rows(study: optuna.Study, k: int, workdir: Path) -> list[dict[str, Any]]:
    attrs = study.user_attrs
    return [trial_row(t, attrs, workdir) for t in _ranked(study)[:k]]


def best_trials(
    name: str, storage: StorageArg = None, k: int = 5, workdir: WorkdirArg = None
) -> pd.DataFrame:
    """The top-k completed trials, best first: number, value, state, one `params_<name>` column
    per parameter, start and duration, and user attributes including `mlflow_run_id`. Its
    columns are there when no trial has completed yet (an empty frame). A multi-objective
    study gives its Pareto front, ordered by the first objective."""
    k = _count(k, "k")
    with reading_study(name, storage, workdir) as study:
        rows = _top_rows(study, k, _workdir(workdir))
        params = sorted(f"params_{p}" for p in _param_names(study))
    frame = pd.DataFrame(rows, columns=[*FIXED_COLUMNS[:3], *params, *FIXED_COLUMNS[3:]])
    for col in frame.columns:
        # pandas 3 makes a text column with a gap its `str` dtype, the gap NaN, which is
        # true (QA: `if row.checkpoint_uri:` held for a deleted file): None, as pandas 2 had.
        if pd.api.types.is_string_dtype(frame[col]) and not pd.api.types.is_object_dtype(
            frame[col]
        ):
            frame[col] = frame[col].astype(object).where(frame[col].notna(), None)
    return frame


def _param_names(study: optuna.Study) -> set[str]:
    """Every parameter of the study: its stored config's search space, and what any trial
    drew (a trial of an older search space), so that a column is there before any trial
    completes, and for a conditional parameter none of the top trials used."""
    import yaml

    names: set[str] = set()
    raw = study.user_attrs.get(CONFIG_ATTR)
    if raw:
        try:
            space = (yaml.safe_load(raw) or {}).get("search_space") or {}
        except (yaml.YAMLError, AttributeError):  # not hpsearch's config: the trials tell
            space = {}
        names.update(str(p) for p in space)
    for t in study.get_trials(deepcopy=False):
        names.update(t.params)
    return names


@dataclass(frozen=True)
class StudyStatus:
    name: str
    counts: dict[str, int]
    best: dict[str, Any] | None
    running: list[dict[str, Any]]
    storage: str
    startup_s_median: float | None = None  # per-trial start-up: ask to first training step
    # A multi-objective study's Pareto front size (`best` is its member first by the first
    # objective); None for a single objective
    pareto_size: int | None = None
    # The budget its launches set (`budget.n_trials`: finished, running and queued trials
    # count; not `studies`' n_trials, its trials of every state), and how many more trials
    # it has room for (`enqueue`); None for a study hpsearch did not launch
    budget: int | None = None
    room: int | None = None


def study_status(name: str, storage: StorageArg = None, workdir: WorkdirArg = None) -> StudyStatus:
    spec = _spec(storage, workdir)
    with reading_study(name, storage, workdir) as study:
        return _status(study, spec, _workdir(workdir))


def _status(study: optuna.Study, spec: StorageSpec, workdir: Path) -> StudyStatus:
    name = study.study_name
    trials = study.get_trials(deepcopy=False)
    counts = {s.name.lower(): 0 for s in TrialState}
    for t in trials:
        counts[t.state.name.lower()] += 1
    ranked = _ranked(study)
    best = trial_row(ranked[0], study.user_attrs, workdir) if ranked else None
    running = [
        {
            "number": t.number,
            "worker": t.user_attrs.get("worker"),
            "host": t.user_attrs.get("host"),
            # Two launches on one host both name their workers host:w0.
            "pid": t.user_attrs.get("pid"),
            "last_epoch": _last_epoch(t),
            "started": t.datetime_start,
            "worker_alive": _worker_alive(t),
        }
        for t in trials
        if t.state == TrialState.RUNNING
    ]
    startups = [float(t.user_attrs["startup_s"]) for t in trials if "startup_s" in t.user_attrs]
    median = statistics.median(startups) if startups else None
    pareto = len(ranked) if len(study.directions) > 1 else None
    budget = study.user_attrs.get(N_TRIALS_ATTR)  # set by every launch
    n_trials = int(budget) if isinstance(budget, int) else None
    room = budget_room(trials, n_trials) if n_trials is not None else None
    return StudyStatus(name, counts, best, running, spec.display, median, pareto, n_trials, room)


def _worker_alive(t: FrozenTrial) -> bool | None:
    """Whether the worker process a running trial names still runs, where this host can
    tell (its own processes); None for another host's. A killed worker's trial stays
    RUNNING until a stale check or the next launch fails and retries it (QA: `status`
    showed it as running for good)."""
    from hpsearch.worker import worker_alive

    return worker_alive(t.user_attrs)


def _last_epoch(t: FrozenTrial) -> int | None:
    """The last epoch a running trial reported: its intermediate values, or in a
    multi-objective study (which keeps none) the attribute its reports write."""
    if t.intermediate_values:
        return max(t.intermediate_values)
    reached = t.user_attrs.get(ATTR_LAST_EPOCH)
    return int(reached) if isinstance(reached, int | float) else None


def list_studies(storage: StorageArg = None, workdir: WorkdirArg = None) -> list[dict[str, Any]]:
    spec = _spec(storage, workdir)
    if not has_optuna_tables(spec):
        if missing := missing_file(spec, storage):
            raise missing
        # A mistyped work folder, not one with no study yet.
        folder = Path(spec.url).parent
        mine = spec.kind == "journal" and folder == _workdir(workdir).resolve()
        if workdir and mine and not folder.is_dir():
            raise StorageError(f"workdir {os.fspath(workdir)}: no such folder")
        return []
    st = open_storage(spec, pool_size=1, create=False)
    try:
        summaries = optuna.get_all_study_summaries(st, include_best_trial=True)
        # Per state: a retried trial's failed tries are trials too, which the budget
        # (`launch`'s `/ N`: complete and pruned) does not count.
        counts = _state_counts(st, [s._study_id for s in summaries])
        out = []
        for s in summaries:
            best = s.best_trial
            single = best is not None and len(s.directions) == 1
            out.append(
                {
                    "name": s.study_name,
                    "n_trials": s.n_trials,
                    "counts": counts.get(s._study_id, {}),
                    "directions": [d.name.lower() for d in s.directions],
                    "best_value": best.value if single and best is not None else None,
                    "best_trial": best.number if best is not None else None,
                    # A multi-objective study's best: the size of its Pareto front
                    "pareto_size": (
                        len(
                            pareto_front(
                                st.get_all_trials(s._study_id, deepcopy=False),
                                [d.name.lower() for d in s.directions],
                            )
                        )
                        if len(s.directions) > 1
                        else None
                    ),
                }
            )
        return out
    finally:
        _dispose(st)


def _state_counts(st: Any, study_ids: Sequence[int]) -> dict[int, dict[str, int]]:
    """Trials per state of each study, in TrialState's order, every state (as `status`
    gives them: a script reading `["fail"]` of a study with none got a KeyError): in one
    query on a database (every trial with all its values was read to count them: seconds
    for studies of long trials), else counted from the trials."""
    raw: dict[int, dict[str, int]] = {i: {} for i in study_ids}
    engine = getattr(st, "engine", None)
    if isinstance(engine, sa.engine.Engine):
        sql = "SELECT study_id, state, count(*) FROM trials GROUP BY study_id, state"
        with engine.connect() as conn:
            for study_id, state, n in conn.execute(sa.text(sql)):
                name = getattr(state, "name", str(state))  # an enum, or its name
                raw.setdefault(int(study_id), {})[name.lower()] = int(n)
    else:
        for i in study_ids:
            for t in st.get_all_trials(i, deepcopy=False):
                raw[i][t.state.name.lower()] = raw[i].get(t.state.name.lower(), 0) + 1
    order = [k.name.lower() for k in TrialState]
    return {i: {k: c.get(k, 0) for k in order} for i, c in raw.items()}


def _local_best_model(trial: FrozenTrial, workdir: Path) -> Path | None:
    """The trial's best-model file when it is on this machine, else under `workdir` (older
    studies stored the path relative to the launch's folder)."""
    stored = trial.user_attrs.get("best_model")
    if not stored:
        return None
    path = Path(str(stored))
    if path.is_absolute() and path.exists():
        return path
    # Not looked for in the current folder (another study's may be there): under the work
    # folder, moved or mounted elsewhere since (QA), or an older study's relative path.
    return _under_workdir(path, workdir)


def load_best_model(
    name: str,
    storage: StorageArg = None,
    tracking_uri: str | None = None,
    *,
    trial: int | None = None,
    workdir: WorkdirArg = None,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """The torch model of the best trial (or of completed trial number `trial`), in eval
    mode on `device` ("cpu", "cuda", "cuda:N", "auto" or a `torch.device`). A
    multi-objective study has no single best: name the trial.

    Weights come from the trial's best-model file when it is on this machine, else from the
    checkpoint logged to MLflow (`tracking_uri`, MLFLOW_TRACKING_URI; with neither, the work
    folder's own MLflow store), downloaded to a temporary folder that is removed after
    loading. The file is loaded with `torch.load(weights_only=True)`: tensors and plain
    values only, never code.
    """
    import tempfile

    from hpsearch.config import config_from_yaml
    from hpsearch.trainer import load_trained_model
    from hpsearch.trainer.trial import resolve_device

    dev = resolve_device(str(device))  # before any download: a bad device fails at once
    trial = _trial_number(trial)
    with reading_study(name, storage, workdir) as study:
        best = _chosen(study, name, trial)
        raw_cfg = trial_config_yaml(study.user_attrs, best)  # the config it trained with
    if not raw_cfg:
        raise HpsearchError(f"study {name!r} has no stored config; was it created by hpsearch?")
    cfg = config_from_yaml(raw_cfg, f"study {name}")
    with tempfile.TemporaryDirectory(prefix="hpsearch-model-") as tmp:
        path = best_model_file(best, tracking_uri, _workdir(workdir), Path(tmp))
        return load_trained_model(cfg, best.params, path, device=dev)


def _trial_number(trial: object) -> int | None:
    """`trial` as an int (numpy's integers too), or None; a bool, a float or text is
    refused rather than matching no trial."""
    if trial is None:
        return None
    try:
        n = operator.index(trial)  # type: ignore[arg-type]
    except TypeError:
        n = -1
    if isinstance(trial, bool) or n < 0:
        raise ConfigError(f"trial: {trial!r}: must be a trial number, a whole number from 0")
    return n


def _chosen(study: optuna.Study, name: str, trial: int | None) -> FrozenTrial:
    if trial is not None:
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        chosen = [t for t in done if t.number == trial]
        if not chosen:
            raise HpsearchError(f"study {name!r}: trial {trial}: no such completed trial")
        return chosen[0]
    if len(study.directions) > 1:
        raise HpsearchError(
            f"study {name!r} is multi-objective: no single best trial; pick one of "
            "best_trials() and pass trial=NUMBER"
        )
    ranked = _ranked(study)
    if not ranked:
        raise HpsearchError(f"study {name!r} has no completed trial yet")
    return ranked[0]


def best_model_file(
    trial: FrozenTrial, tracking_uri: str | None, workdir: Path, dest: Path
) -> Path:
    """Where a trial's best model is read from: its file when this host ran it; for a trial
    another host ran, the copy its MLflow run holds first (a file at its path here may be
    an earlier try's of its chain, which this host ran), else the file (a work folder the
    hosts share). A download goes into `dest`."""
    from hpsearch.runs import download_best_model

    local = _local_best_model(trial, workdir)
    elsewhere = trial.user_attrs.get("host") not in (None, socket.gethostname())
    if local is not None and not (elsewhere and trial.user_attrs.get("checkpoint_uri")):
        return local
    try:
        return Path(download_best_model(trial, tracking_uri, workdir, dest))
    except HpsearchError:
        if local is None:
            raise
        return local


@dataclass(frozen=True)
class Enqueued:
    """What `enqueue_trial` did: trial `number` holds the params, queued now (`queued`) or
    already in the study (in `state`: a trial queued, run or failed with them)."""

    number: int
    queued: bool
    state: str
    params: dict[str, Any]


def enqueue_trial(
    name: str,
    params: Mapping[str, Any],
    storage: StorageArg = None,
    workdir: WorkdirArg = None,
    *,
    n_trials: int | None = None,
) -> Enqueued:
    """Queue a trial of `params` in study `name`, to run before the sampler draws another
    (Optuna's `enqueue_trial`; the study's workers take queued trials first, a running
    launch's too). `params` are searched parameters, checked against the search space the
    study was launched with as its `enqueue_trials` are; the others are drawn. Params the
    study already holds (compared as Optuna's `skip_if_exists`) are not queued again, and
    none past the study's `budget.n_trials` (HpsearchError). `n_trials`: set that budget
    first, under the same lock (raised from a spent one, a launch then given `--trials N`
    had its workers fill the room before the trial was queued). Raises ConfigError for
    params the study could not run as given, StudyNotFoundError for a study hpsearch did
    not make."""
    from hpsearch.config import check_enqueued, config_from_yaml

    study, st = _open(name, storage, workdir)
    try:
        stored = study.user_attrs.get(CONFIG_ATTR)
        if not stored:
            raise StudyNotFoundError(
                f"study {name!r} has no config of hpsearch's (made by plain Optuna?): "
                "queue its trials with optuna's study.enqueue_trial"
            )
        cfg = config_from_yaml(str(stored), f"study {name} (the config it was launched with)")
        if not isinstance(params, Mapping):
            raise ConfigError(f"params: {params!r}: must be a mapping of names to values")
        entry = check_enqueued(cfg, params, "params", sep=": ")
        if n_trials is not None:
            n_trials = _count(n_trials, "n_trials")

        def locked() -> Enqueued:
            with study_lock(_spec(storage, workdir), name):
                refresh_trials_now(study)
                trials = study.get_trials(deepcopy=False)
                if (t := holding_trial(entry, trials)) is not None:
                    held = t.system_attrs.get("fixed_params", t.params)
                    return Enqueued(t.number, False, t.state.name.lower(), dict(held))
                budget = study_budget(study, cfg) if n_trials is None else n_trials
                if budget_room(trials, budget) == 0:
                    raise HpsearchError(
                        f"study {name!r}: budget.n_trials ({budget}) has no room for "
                        "another trial (finished, running and queued ones count): raise it "
                        "as you queue it (hpsearch enqueue --trials "
                        f"{budget_used(trials) + 1} ...)"
                        if n_trials is None
                        else f"n_trials: {n_trials}: leaves study {name!r} no room for "
                        "another trial (finished, running and queued ones count)"
                    )
                if n_trials is not None and study_budget(study, cfg) != n_trials:
                    study.set_user_attr(N_TRIALS_ATTR, n_trials)
                study.enqueue_trial(entry)
                refresh_trials_now(study)
                for t in reversed(study.get_trials(deepcopy=False)):
                    if (
                        t.state == TrialState.WAITING
                        and t.system_attrs.get("fixed_params") == entry
                    ):
                        return Enqueued(t.number, True, "waiting", entry)
                raise StorageError(f"study {name!r}: the queued trial was not read back")

        return with_db_retry(locked, what="queue a trial")
    finally:
        _dispose(st)
