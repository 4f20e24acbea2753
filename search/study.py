"""Optuna pieces built from a StudyConfig: sampler, pruner, study, and parameter suggestion."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import math
import socket
import uuid
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml
from hpsearch.config import (
    HPARAM_NAMES,
    FloatParam,
    Hyperparams,
    IntParam,
    StudyConfig,
    check_enqueued,
    config_from_yaml,
    config_to_yaml,
    enqueued_trials,
    grid_space,
    load_yaml,
)
from hpsearch.errors import ConfigError, HpsearchWarning, StudyNotFoundError
from hpsearch.storage import refresh_trials_now
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    check_distribution_compatibility,
)
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

# Study user attribute holding the resolved study YAML (for load_best_model and reproducing).
CONFIG_ATTR = "hpsearch.config"
# Every config a worker ran trials with, as a study user attribute each (this prefix and
# the config's id: its YAML), and the id on each trial (a user attribute): a relaunch with
# other --set values replaces CONFIG_ATTR, and a worker may run with --set values of its
# own, so the study's config alone reproduced an earlier trial with today's settings.
CONFIG_OF_ATTR = "hpsearch.config."
CONFIG_ID_ATTR = "hpsearch.config_id"
# The ids of the configs launches ran with (a list): any other is a worker's own --set.
LAUNCH_IDS_ATTR = "hpsearch.launch_config_ids"
# A study attribute per trial whose MLflow run was made after the trial had finished (it
# ended while the server was down): Optuna takes no attribute on a finished trial.
LATE_RUN_ATTR = "mlflow_run_id.{number}"
# Optuna constraint set on every trial: > 0 (infeasible) for out-of-memory trials, so that
# constrained samplers (TPE, NSGA-II, GP) learn the memory boundary.
MEMORY_CONSTRAINT = "memory"


_PLAIN_TYPES: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "None": lambda v: v is None,
}


def check_option(annotation: Any, value: Any) -> Any:
    """`value` for a parameter annotated `annotation` (a string, as Optuna's modules write
    them, or a type) when the annotation is a union of int, float, bool, str and None: a
    whole float for an int (`1e1` is 10), else TypeError saying what it must be. Any richer
    annotation is left to the class. A sampler stores an option such as TPE's
    n_startup_trials unchecked and fails on it only when a trial asks, in a worker."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None)
    text = text or str(annotation)
    parts = [part.strip() for part in text.split("|")]
    if not all(part in _PLAIN_TYPES for part in parts):
        return value
    if any(_PLAIN_TYPES[part](value) for part in parts):
        return value
    if "int" in parts and isinstance(value, float) and value.is_integer():
        return int(value)
    raise TypeError(f"{value!r}: must be {' or '.join(parts)}")


# A sampler's arguments the study file gives elsewhere (config._check_new_file refuses them
# among its options): not offered as options in an error.
_SET_ELSEWHERE = {"seed": "sampler.seed", "search_space": "the study's search_space"}


def _kwargs_for(cls: type, options: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    accepted = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        offered = [p for p in accepted if p != "self" and p not in _SET_ELSEWHERE]
        elsewhere = [f"{p} is {_SET_ELSEWHERE[p]}" for p in accepted if p in _SET_ELSEWHERE]
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for {cls.__name__}; "
            f"accepted: {', '.join(offered) or 'none'}"
            + (f" ({'; '.join(elsewhere)})" if elsewhere else "")
        )
    checked = {}
    for name, value in options.items():
        try:
            checked[name] = check_option(accepted[name].annotation, value)
        except TypeError as exc:
            raise TypeError(f"{name}: {exc} ({cls.__name__})") from exc
    kwargs = {k: v for k, v in extra.items() if k in accepted}
    kwargs.update(checked)
    return kwargs


class BudgetedGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler without its `study.stop()` once the grid is covered: that works
    inside `study.optimize` only, and raised from a worker's tell after the trial was stored
    (the trial then read as failed, and the worker died). The study's budget, at most the
    grid's size (`config.grid_space`), ends a grid study.

    `seed` shuffles the grid, and a trial's stored `grid_id` indexes the shuffled grid, so
    every worker, restart and relaunch takes the study's (with a seed of its own each, a
    grid id meant another point in each: points were trained twice and others never).
    `pick_seed` draws which unvisited id a trial past the grid's size takes (retries use up
    trial numbers): the worker's own, so that two workers building trials at once (outside
    the study lock) seldom take the same one."""

    def __init__(
        self,
        search_space: Mapping[str, Sequence[Any]],
        seed: int | None = None,
        pick_seed: int | None = None,
    ) -> None:
        super().__init__(search_space, seed=seed)
        self._rng.rng.seed(pick_seed)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        return None


def sampler_seed(seed: int | None, stream: int, trials_before: int) -> int | None:
    """The seed a worker's sampler draws with. Optuna's samplers draw from their seed's
    sequence, so workers sharing the study's seed propose the same parameters (all random
    start-up trials alike), and a restarted worker or a later launch replays them. The first
    worker of a fresh study keeps the study's seed (one worker reproduces plain Optuna with
    it); every other worker (`stream`), restart and resumed study (`trials_before`, the
    trials already there) draws from a seed of its own, derived from the study's."""
    if seed is None or (stream == 0 and trials_before == 0):
        return seed
    digest = hashlib.sha256(f"{seed}:{stream}:{trials_before}".encode()).digest()
    return int.from_bytes(digest[:4], "big")  # numpy's seeds are < 2**32


# System attr of an enqueued trial a launch failed unrun: its params were outside the search
# space the study was launched with (`enqueue_trials`, owner). It holds none of its params:
# queueing them again is allowed.
ATTR_UNFIT = "hpsearch:unfit_queued"


def never_ran(t: FrozenTrial) -> bool:
    """An enqueued trial still queued, or failed unrun by a launch (`ATTR_UNFIT`)."""
    queued = t.state == TrialState.WAITING or ATTR_UNFIT in t.system_attrs
    return queued and "fixed_params" in t.system_attrs and not t.params


def trials_before(trials: Sequence[FrozenTrial]) -> int:
    """The trials a worker's seed counts as already there (`sampler_seed`): all but the
    enqueued ones never run, which a launch queues (or fails) while its first worker starts
    (before or after it counts: its seed would depend on which came first)."""
    return sum(1 for t in trials if not never_ran(t))


def make_sampler(
    cfg: StudyConfig, stream: int = 0, trials_before: int = 0, *, quiet: bool = True
) -> optuna.samplers.BaseSampler:
    """The study file's sampler, seeded for worker `stream` (`sampler_seed`). `quiet`:
    without Optuna's FutureWarnings (deprecated options), which the study file's load
    turned into one line naming its field (config._check_components)."""
    s = cfg.sampler
    classes: dict[str, type] = {
        "tpe": optuna.samplers.TPESampler,
        "gp": optuna.samplers.GPSampler,
        "cmaes": optuna.samplers.CmaEsSampler,
        "random": optuna.samplers.RandomSampler,
        "grid": BudgetedGridSampler,
        "nsga2": optuna.samplers.NSGAIISampler,
    }
    cls = classes[s.name]
    extra: dict[str, Any] = {"seed": sampler_seed(s.seed, stream, trials_before)}
    if s.name == "grid":  # the grid's order is the study's seed (BudgetedGridSampler)
        extra["search_space"] = grid_space(cfg)
        extra["pick_seed"] = extra["seed"]
        extra["seed"] = s.seed
    if s.name == "cmaes":
        # Conditional and categorical params fall back to this, quietly.
        extra["warn_independent_sampling"] = False
    with warnings.catch_warnings():
        # The study file chose these options (TPE's group, multivariate, constant_liar);
        # Optuna's "experimental" notice on every worker start is noise, not news.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if quiet:
            warnings.simplefilter("ignore", FutureWarning)
        return cls(**_kwargs_for(cls, dict(s.options), extra))


def make_pruner(cfg: StudyConfig, *, quiet: bool = True) -> optuna.pruners.BasePruner:
    """The study file's pruner; `quiet` as `make_sampler`'s."""
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", FutureWarning)
        return _make_pruner(cfg)


def _make_pruner(cfg: StudyConfig) -> optuna.pruners.BasePruner:
    p = cfg.pruner
    epochs = cfg.budget.max_epochs
    if p.name == "none":
        if p.options:
            raise TypeError("pruner 'none' takes no options: make pruner.options {}")
        return optuna.pruners.NopPruner()
    if p.name == "median":
        cls: type = optuna.pruners.MedianPruner
        extra: dict[str, Any] = {"n_startup_trials": 3, "n_warmup_steps": 1}
    elif p.name in ("asha", "successive_halving"):
        cls = optuna.pruners.SuccessiveHalvingPruner
        extra = {"min_resource": 1, "reduction_factor": 3}
    else:
        cls = optuna.pruners.HyperbandPruner
        extra = {"min_resource": 1, "max_resource": epochs, "reduction_factor": 3}
    return cls(**_kwargs_for(cls, dict(p.options), extra))


REHEARSAL_TRIALS = 4


class RehearsalError(Exception):
    """The study's `section` ("sampler" or "pruner") failed a made-up trial; the cause is
    chained."""

    def __init__(self, section: str) -> None:
        super().__init__(section)
        self.section = section


def rehearse(cfg: StudyConfig) -> None:
    """Run `REHEARSAL_TRIALS` made-up trials through the study's sampler and pruner on an
    in-memory study over its search space: Optuna checks many options only when a trial
    asks or the pruner decides (TPE's n_ei_candidates and prior_weight, Hyperband's
    reduction_factor, CMA-ES's package). TPE models from its second trial here; GP's model
    is not fitted (seconds of torch per load). Raises RehearsalError."""
    options = dict(cfg.sampler.options)
    if cfg.sampler.name == "tpe":
        options["n_startup_trials"] = min(int(options.get("n_startup_trials", 10)), 1)
    elif cfg.sampler.name == "gp":
        options["n_startup_trials"] = REHEARSAL_TRIALS
    sampler_cfg = cfg.model_copy(
        update={"sampler": cfg.sampler.model_copy(update={"options": options})}
    )
    n_trials = REHEARSAL_TRIALS
    if cfg.sampler.name == "grid":  # a smaller grid would warn that it is exhausted
        n_trials = min(n_trials, math.prod(len(v) for v in grid_space(cfg).values()))
    # The made-up trials' notices (independent sampling, deprecated options: the first
    # build showed those) are noise, and so is the in-memory study's "created" line.
    with warnings.catch_warnings(), _quiet(logging.getLogger("optuna")):
        warnings.simplefilter("ignore")
        try:
            sampler = make_sampler(sampler_cfg)
        except (TypeError, ValueError) as exc:
            raise RehearsalError("sampler") from exc
        try:
            pruner = make_pruner(cfg)
        except (TypeError, ValueError) as exc:
            raise RehearsalError("pruner") from exc
        storage = optuna.storages.InMemoryStorage()
        directions = [optuna.study.StudyDirection[d.upper()] for d in cfg.objective.directions]
        storage.create_new_study(directions, "rehearsal")
        study = optuna.Study("rehearsal", storage, sampler=sampler, pruner=pruner)
        _rehearse_trials(cfg, study, n_trials, len(directions))


def _drop(record: logging.LogRecord) -> bool:
    return False


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """Drop what `logger`'s own handlers (Optuna's stderr handler) would print meanwhile."""
    handlers = list(logger.handlers)
    for handler in handlers:
        handler.addFilter(_drop)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(_drop)


def _rehearse_trials(cfg: StudyConfig, study: optuna.Study, n_trials: int, n_values: int) -> None:
    steps = range(1, min(cfg.budget.max_epochs, 3) + 1)
    for i in range(n_trials):
        values = [0.1 + 0.2 * ((i * 7 + k) % 4) for k in range(n_values)]
        try:
            trial = study.ask()
            suggest(trial, cfg)
        except Exception as exc:  # anything a sampler's option can make it raise
            raise RehearsalError("sampler") from exc
        for step in steps if n_values == 1 else ():  # Optuna prunes single objectives only
            trial.report(values[0] * step / len(steps), step)
            try:
                if trial.should_prune():
                    break
            except Exception as exc:  # anything a pruner's option can make it raise
                raise RehearsalError("pruner") from exc
        try:
            study.tell(trial, values if n_values > 1 else values[0])
        except Exception as exc:  # a sampler's after_trial
            raise RehearsalError("sampler") from exc


N_TRIALS_ATTR = "hpsearch.n_trials"  # study user attribute: the budget workers obey
# Study user attribute: a name for this Optuna study of its own, which its MLflow runs carry
# (`hpsearch.study_uid`): another study of its name (another storage's, or one deleted and
# made again) logs to the same experiment, under a study run of its own.
STUDY_UID_ATTR = "hpsearch.study_uid"


def study_uid(
    study: optuna.Study,
    mint: bool = False,
    lock: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
) -> str | None:
    """The study's uid; None where it has none yet. `mint` (its launch, a worker of its own)
    gives it one then, under `lock` (`study_lock`): of two first launches or workers at
    once, the second reads the first's. Without a lock (Optuna's storages have no
    compare-and-set) both may write theirs: the one recorded is returned."""
    storage, sid = study._storage, study._study_id
    uid = storage.get_study_user_attrs(sid).get(STUDY_UID_ATTR)
    if not uid and mint:
        with lock() if lock is not None else contextlib.nullcontext():
            uid = storage.get_study_user_attrs(sid).get(STUDY_UID_ATTR)
            if not uid:
                storage.set_study_user_attr(sid, STUDY_UID_ATTR, uuid.uuid4().hex)
                uid = storage.get_study_user_attrs(sid).get(STUDY_UID_ATTR)
    return str(uid) if uid else None


def study_budget(study: optuna.Study, cfg: StudyConfig) -> int:
    """The study's n_trials as the last launch set it; the config's when none did."""
    return int(study.user_attrs.get(N_TRIALS_ATTR, cfg.budget.n_trials))


def check_sampler_fits(cfg: StudyConfig, trials: Sequence[FrozenTrial]) -> None:
    """Refuse Optuna's GP sampler on a study with completed trials that carry no memory
    constraint (plain Optuna's, or an earlier version's of a sampler other than TPE,
    NSGA-II or GP): it refuses trials that differ in their constraints, and every trial
    from now on carries one (ConfigError)."""
    if cfg.sampler.name != "gp":
        return
    bare = [
        t.number
        for t in trials
        if t.state == TrialState.COMPLETE and MEMORY_CONSTRAINT not in t.constraints
    ]
    if bare:
        shown = ", ".join(map(str, bare[:5])) + (", ..." if len(bare) > 5 else "")
        raise ConfigError(
            f"{cfg.source or cfg.name}: sampler.name: 'gp': completed trials {shown} of study "
            f"{cfg.name!r} carry no {MEMORY_CONSTRAINT!r} constraint (made by plain Optuna or "
            "an earlier hpsearch), and Optuna's GP sampler needs every completed trial to "
            "carry the same: search this study with 'tpe', or start one under another `name`"
        )


def create_or_load(
    cfg: StudyConfig, storage: BaseStorage | str, owner: bool = True, budget: bool = False
) -> optuna.Study:
    """The study named in the config; created on first launch, resumed after.

    The owner (`launch`) records the resolved config and the budget on the study; workers
    only fill them in when missing, and with `budget` (a worker given --trials, or a
    --set of budget.n_trials) record the budget: their other --set values are theirs, and
    the stored config is what earlier trials ran with (trial_config, load_best_model).
    """
    kwargs: dict[str, Any] = {"study_name": cfg.name, "storage": storage, "load_if_exists": True}
    kwargs["sampler"] = make_sampler(cfg)
    kwargs["pruner"] = make_pruner(cfg)
    if cfg.objective.multi:
        kwargs["directions"] = list(cfg.objective.directions)
    else:
        kwargs["direction"] = cfg.objective.directions[0]
    study = optuna.create_study(**kwargs)
    # Checked before anything is recorded: a refused launch leaves the study as it was;
    # the metric first, as another metric's directions differ too (QA: the direction's
    # hint then led to a study of val_loss maximized).
    # Named by the first launch (below); a study of plain Optuna's has none.
    named = study.metric_names
    if named is not None and list(named) != list(cfg.objective.metrics):
        given = named[0] if len(named) == 1 else list(named)
        raise ConfigError(
            f"{cfg.source or cfg.name}: objective.metric: {cfg.objective.metric!r}: study "
            f"{cfg.name!r} already exists with metric {given!r}, and one study's values are "
            f"of one metric: add `metric: {given}` to go on with it, or start a study under "
            "another `name`"
        )
    existing = [d.name.lower() for d in study.directions]
    if existing != [d.lower() for d in cfg.objective.directions]:
        # A file with no direction takes each metric's own (val_loss minimizes); a study
        # begun before that default maximized it.
        given = existing[0] if len(existing) == 1 else existing
        hint = (
            f"; the file gives none: add `direction: {given}` to go on with it"
            if cfg.objective.direction is None
            else ""
        )
        raise ConfigError(
            f"{cfg.source or cfg.name}: objective.direction: {list(cfg.objective.directions)}: "
            f"study {cfg.name!r} already exists with directions {existing}{hint}"
        )
    trials = study.get_trials(deepcopy=False)
    check_space_fits(cfg, trials)
    check_sampler_fits(cfg, trials)
    attrs = study.user_attrs
    first = CONFIG_ATTR not in attrs
    if owner and not first:
        check_retries_fit(cfg, str(attrs[CONFIG_ATTR]), trials, attrs)
        changed = [
            f"{key}: {now!r} (before: {was!r})"
            for key, now, was in _drift_from(cfg, str(attrs[CONFIG_ATTR]))
        ]
        if trials and changed:
            # Allowed (a study goes on at a longer budget), but said, as a worker says it.
            shown = "; ".join(changed[:6]) + ("; ..." if len(changed) > 6 else "")
            warnings.warn(
                f"study {cfg.name}: this launch's trials train otherwise than its last "
                f"launch's ({shown}): their values will not compare",
                HpsearchWarning,
                stacklevel=2,
            )
    resolved = config_to_yaml(cfg)
    if (owner or first) and attrs.get(CONFIG_ATTR) != resolved:
        study.set_user_attr(CONFIG_ATTR, resolved)
    own = config_to_yaml(cfg, trial_only=True)  # what this process's trials run with
    cid = config_id(own)
    if attrs.get(CONFIG_OF_ATTR + cid) != own:
        study.set_user_attr(CONFIG_OF_ATTR + cid, own)
    launched = list(attrs.get(LAUNCH_IDS_ATTR) or [])
    if (owner or first) and cid not in launched:
        study.set_user_attr(LAUNCH_IDS_ATTR, [*launched, cid])
    if (owner or first or budget) and attrs.get(N_TRIALS_ATTR) != cfg.budget.n_trials:
        study.set_user_attr(N_TRIALS_ATTR, cfg.budget.n_trials)
    if first and study.metric_names is None:
        # Named in Optuna's dashboard and plots ("val_acc", "train_seconds"), not as
        # "objective 0", "objective 1".
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(list(cfg.objective.metrics))
    return study


# Fields that change how a trial runs, not what its value means (where the data is, its
# loading, checkpoints, telemetry, numerics' speed-ups) or which trials run (budget size,
# queue, sampler, pruner, space): a worker may set these its own way (`config_drift`).
OPERATIONAL_FIELDS = (
    "name", "description", "enqueue_trials", "sampler", "pruner", "search_space", "tracking",
    "budget.n_trials", "budget.timeout_s", "dataset.root", "dataset.download",
    "dataset.fast_path", "dataset.max_cache_mb", "trainer.num_workers", "trainer.checkpoint",
    "trainer.checkpoint_every_s", "trainer.compile", "trainer.cudnn_benchmark",
    "trainer.channels_last", "trainer.precision", "trainer.max_micro_batch",
    "trainer.evaluate_test",
)  # fmt: skip


def config_drift(cfg: StudyConfig, stored_yaml: str) -> list[str]:
    """How trials of `cfg` train otherwise than those of the stored config (a launch's),
    in what makes their values differ: `field: value (the launch's: other)` per field,
    none of `OPERATIONAL_FIELDS`. The stored config is read as a study's (its missing
    newer fields take their defaults); one that does not load any more counts as none."""
    return [
        f"{key}: {now!r} (the launch's: {was!r})" for key, now, was in _drift_from(cfg, stored_yaml)
    ]


def other_configs(trials: Sequence[FrozenTrial], known: Collection[str]) -> dict[str, int]:
    """The config ids (CONFIG_ID_ATTR) of `trials` (in number order, as Optuna gives them)
    that are not in `known`, each with its first trial's number."""
    found: dict[str, int] = {}
    for t in trials:
        cid = t.user_attrs.get(CONFIG_ID_ATTR)
        if isinstance(cid, str) and cid not in known and cid not in found:
            found[cid] = t.number
    return found


def others_drift_note(cfg: StudyConfig, number: int, stored_yaml: str) -> str:
    """A launch's line for trial `number`, run with another config (another launch's of the
    study, or a worker's own --set values) whose trials train otherwise than `cfg`'s; ''
    where they train alike (only `OPERATIONAL_FIELDS` differ) or it does not load."""
    changed = _drift_from(cfg, stored_yaml)
    if not changed:
        return ""
    shown = "; ".join(f"{key}: {was!r} (here: {now!r})" for key, now, was in changed[:6])
    return (
        f"trial {number}, of another launch or worker, trains otherwise than this launch's "
        f"({shown}{'; ...' if len(changed) > 6 else ''}): their values will not compare"
    )


def _drift_from(cfg: StudyConfig, stored_yaml: str) -> list[tuple[str, Any, Any]]:
    try:
        stored = config_from_yaml(stored_yaml, "stored")
    except ConfigError:
        return []
    return drift(cfg, stored)


def drift(cfg: StudyConfig, stored: StudyConfig) -> list[tuple[str, Any, Any]]:
    """(field, value in `cfg`, value in `stored`) for each field, none of
    `OPERATIONAL_FIELDS`, in which trials of the two configs train otherwise; by name."""

    def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(value, dict) and value:
            out: dict[str, Any] = {}
            for key, sub in value.items():
                out.update(leaves(sub, f"{prefix}.{key}" if prefix else str(key)))
            return out
        return {prefix: value}

    a = leaves(load_yaml(config_to_yaml(cfg, trial_only=True)))
    b = leaves(load_yaml(config_to_yaml(stored, trial_only=True)))
    return [
        (key, a.get(key), b.get(key))
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key) and not _within(key, OPERATIONAL_FIELDS)
    ]


def _within(key: str, fields: Sequence[str]) -> bool:
    return any(key == f or key.startswith(f + ".") for f in fields)


CLASSES_ATTR = "hpsearch.classes"  # study user attribute: the class names trials train on


def check_classes(study: optuna.Study, cfg: StudyConfig, names: Sequence[str]) -> list[str]:
    """`names` (the train split's classes, in output order) are the ones the study's trials
    trained on, which its first worker records (under the study lock); those. A class added
    to an image folder between launches made every retry's checkpoint unloadable (a raw
    size mismatch) and put 5- and 6-class values in one study. Raises DatasetError."""
    from hpsearch.errors import DatasetError
    from hpsearch.trainer.data import class_change

    stored = study.user_attrs.get(CLASSES_ATTR)
    if stored is None:
        study.set_user_attr(CLASSES_ATTR, list(names))
        return list(names)
    if (changed := class_change(list(stored), names)) is not None:
        raise DatasetError(f"dataset {cfg.dataset.name}: {changed}")
    return list(stored)


def config_id(resolved: str) -> str:
    """A resolved config's id: the first 16 hex digits of its YAML's SHA-256."""
    return hashlib.sha256(resolved.encode()).hexdigest()[:16]


def trial_config_id(cfg: StudyConfig) -> str:
    """The id each trial run with `cfg` records (CONFIG_ID_ATTR; create_or_load records
    the config under it)."""
    return config_id(config_to_yaml(cfg, trial_only=True))


def trial_config_yaml(study_attrs: Mapping[str, Any], trial: FrozenTrial) -> str | None:
    """The resolved config `trial` ran with: the one its id names, else (a trial from
    before ids were recorded) the study's; None for a study hpsearch did not make."""
    cid = trial.user_attrs.get(CONFIG_ID_ATTR)
    own = study_attrs.get(CONFIG_OF_ATTR + str(cid)) if cid else None
    stored = own or study_attrs.get(CONFIG_ATTR)
    return str(stored) if stored else None


def same_params(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two trials' fixed or drawn params are one trial's, as Optuna's
    `enqueue_trial(skip_if_exists=True)` judges it: the same names, floats equal within
    rounding, other values equal and of one type (a choice 1 is not True)."""
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if isinstance(x, float) and isinstance(y, float):
            if not math.isclose(x, y, rel_tol=1e-9, abs_tol=0.0):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def holding_trial(params: Mapping[str, Any], trials: Sequence[FrozenTrial]) -> FrozenTrial | None:
    """The trial that already holds `params` (queued, run or failed, under its fixed params
    or as drawn), if one does: not one a launch failed unrun (`ATTR_UNFIT`)."""
    for t in trials:
        held = t.system_attrs.get("fixed_params", t.params)
        if ATTR_UNFIT not in t.system_attrs and same_params(params, held):
            return t
    return None


def budget_room(trials: Sequence[FrozenTrial], n_trials: int) -> int:
    """Trials that may still be queued: finished, running and queued ones together stay
    within `n_trials`, as `may_start_trial` keeps drawn ones (a queued trial is always
    taken); failed ones do not count."""
    return max(n_trials - budget_used(trials), 0)


def budget_used(trials: Sequence[FrozenTrial]) -> int:
    """The trials that count against `budget.n_trials`: finished, running and queued."""
    counts = budget_counts(trials)
    return sum(counts.get(k, 0) for k in ("complete", "pruned", "running", "waiting"))


def trials_to_enqueue(
    wanted: Sequence[Mapping[str, Any]], trials: Sequence[FrozenTrial], n_trials: int
) -> tuple[list[dict[str, Any]], int]:
    """(the `enqueue_trials` to queue now, how many of the rest the budget has no room
    for): those no trial holds (`holding_trial`), while `budget_room` lasts."""
    new = [dict(p) for p in wanted if holding_trial(p, trials) is None]
    take = new[: budget_room(trials, n_trials)]
    return take, len(new) - len(take)


@dataclass(frozen=True)
class Queued:
    """What `enqueue_trials` did: how many enqueued trials wait in the queue now (queued
    here or before), how many the budget had no room for, and the queued ones it failed as
    outside the search space (trial number, why)."""

    waiting: int = 0
    left: int = 0
    failed: tuple[tuple[int, str], ...] = ()


def unfit_queued(cfg: StudyConfig, trials: Sequence[FrozenTrial]) -> list[tuple[FrozenTrial, str]]:
    """Enqueued trials still queued (never started) whose params the search space of `cfg`
    no longer takes (a relaunch narrowed it), with why: Optuna would run them as given,
    outside it, with a warning in one worker's log."""
    out = []
    for t in trials:
        fixed = t.system_attrs.get("fixed_params")
        if t.state != TrialState.WAITING or t.params or not isinstance(fixed, dict):
            continue
        try:
            check_enqueued(cfg, fixed, "params", sep=": ")
        except ConfigError as exc:
            out.append((t, str(exc)))
    return out


def _fail_unrun(study: optuna.Study, t: FrozenTrial, why: str) -> None:
    """Fail an enqueued trial never run, as its params do not fit the launch's space."""
    storage = study._storage
    reason = f"its queued params do not fit the search space the study was launched with: {why}"
    storage.set_trial_system_attr(t._trial_id, ATTR_UNFIT, True)
    storage.set_trial_user_attr(t._trial_id, "outcome", "error")  # worker.ATTR_OUTCOME
    storage.set_trial_user_attr(t._trial_id, "message", reason[:500])  # worker.ATTR_MESSAGE
    storage.set_trial_state_values(t._trial_id, TrialState.FAIL)


def enqueue_trials(
    study: optuna.Study,
    cfg: StudyConfig,
    lock: Callable[[], contextlib.AbstractContextManager[Any]],
    owner: bool = False,
) -> Queued:
    """Queue the study's `enqueue_trials` that it does not hold yet, under the study lock
    (a worker's count and claim, and another process queueing them, wait for it). They are
    those of the config the study was launched with (stored on it), else `cfg`'s: a worker
    of its own file queues no entries a launch left out. The owner (`launch`) also fails
    the queued ones its search space no longer takes (`unfit_queued`), recording why."""
    with lock():
        # The stored config read under the lock: a relaunch stores its own before it takes
        # the lock to fail what its space refuses, so whichever comes first, nothing queued
        # by the config it replaced is left outside its space.
        entries = cfg
        stored = study.user_attrs.get(CONFIG_ATTR) if not owner else None
        if stored:
            with contextlib.suppress(ConfigError):  # an older version's: the worker's own
                entries = config_from_yaml(str(stored), f"study {cfg.name}")
        wanted = enqueued_trials(entries)
        if not wanted and not owner:
            return Queued()
        refresh_trials_now(study)  # a worker's view may be throttled: queued a moment ago?
        trials = study.get_trials(deepcopy=False)
        failed: list[tuple[int, str]] = []
        if owner:
            for t, why in unfit_queued(cfg, trials):
                if study._storage.get_trial(t._trial_id).state != TrialState.WAITING:
                    continue  # taken meanwhile (the lock's session lost): it runs
                _fail_unrun(study, t, why)
                failed.append((t.number, why))
            if failed:
                refresh_trials_now(study)
                trials = study.get_trials(deepcopy=False)
        if not wanted:
            return Queued(failed=tuple(failed))
        take, left = trials_to_enqueue(wanted, trials, study_budget(study, cfg))
        for params in take:
            study.enqueue_trial(params)
    queued = [
        t.system_attrs["fixed_params"]
        for t in trials
        if t.state == TrialState.WAITING and isinstance(t.system_attrs.get("fixed_params"), dict)
    ]
    before = sum(1 for p in wanted if any(same_params(p, q) for q in queued))
    return Queued(before + len(take), left, tuple(failed))


def enqueued_text(waiting: int, left: int, n_trials: int, src: str) -> str:
    """The launch's line on `enqueue_trials`: how many wait to run first, how many the
    budget has no room for."""
    parts = [f"{waiting} queued to run first"] if waiting else []
    if left:
        parts.append(f"{left} not queued: budget.n_trials ({n_trials}) has no room for them")
    return f"{src}: enqueue_trials: {'; '.join(parts)}"


def load_existing(
    name: str, storage: BaseStorage | str, cfg: StudyConfig | None = None
) -> optuna.Study:
    sampler = make_sampler(cfg) if cfg is not None else None
    pruner = make_pruner(cfg) if cfg is not None else None
    try:
        return optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError as exc:
        raise StudyNotFoundError(
            f"study {name!r} not found in the storage; "
            f"create it with `hpsearch launch --study {name}`"
        ) from exc


def space_distributions(cfg: StudyConfig) -> dict[str, BaseDistribution]:
    """Each search-space parameter's distribution, as `suggest` asks Optuna for it."""
    out: dict[str, BaseDistribution] = {}
    with warnings.catch_warnings():  # Optuna's "range is not divisible by step": said once
        warnings.simplefilter("ignore")  # by the trial's own suggestion, not at every load
        for name, spec in cfg.search_space.items():
            if isinstance(spec, FloatParam):
                out[name] = FloatDistribution(spec.low, spec.high, log=spec.log, step=spec.step)
            elif isinstance(spec, IntParam):
                out[name] = IntDistribution(spec.low, spec.high, log=spec.log, step=spec.step)
            else:
                out[name] = CategoricalDistribution(spec.choices)
    return out


def check_space_fits(cfg: StudyConfig, trials: Sequence[FrozenTrial]) -> None:
    """Refuse a search space that Optuna would refuse for this study's later trials: it
    keeps a categorical parameter's choices, and a parameter's kind and log scale, for the
    life of a study (ranges may change). Every new trial, and every queued retry, would
    fail at its first suggestion: the retries' checkpoints lost, the workers stopped."""
    if not trials:
        return
    wanted = space_distributions(cfg)
    # Optuna checks every write of a name against its first, so one stored use of each
    # name stands for all (a study of 100k trials is not read through at every start).
    left = set(wanted)
    for trial in trials:
        if not left:
            return
        for name, stored in trial.distributions.items():
            if name not in left:
                continue
            left.discard(name)
            dist = wanted[name]
            try:
                check_distribution_compatibility(stored, dist)
            except ValueError:
                raise ConfigError(
                    f"{cfg.source or cfg.name}: search_space.{name}: {_space_text(dist)}: "
                    f"study {cfg.name!r} has trials with {_space_text(stored)}, and Optuna "
                    "keeps a parameter's choices, kind and log scale for the whole study: "
                    "change it back, or start a study under another `name`"
                ) from None


# System attr of a retry: the host its failed try ran on (whose disk holds its checkpoint).
# The try's own "host" user attr is not inherited: it names the retry's owner once taken.
ATTR_FAILED_HOST = "hpsearch:failed_host"


def check_retries_fit(
    cfg: StudyConfig,
    stored: str,
    trials: Sequence[FrozenTrial],
    study_attrs: Mapping[str, Any] | None = None,
) -> None:
    """Refuse a config under which a retry waiting to resume from its checkpoint would get
    other hyperparameters than it trained with (its try's config, which `study_attrs`
    hold by id, else the study's `stored` one: a changed `trainer.defaults` value): the
    trainer refuses that checkpoint, and the retry failed for good, its epochs lost.
    Likewise other eval settings (`trainer.eval_scale`'s size, `trainer.eval_flip`,
    `dataset.eval_limit`): its best so far would be compared with values taken otherwise."""
    waiting = [  # "checkpoint": worker.ATTR_CHECKPOINT (the worker imports this module)
        t for t in trials if t.state == TrialState.WAITING and t.user_attrs.get("checkpoint")
    ]
    host = socket.gethostname()
    parsed: dict[str, StudyConfig | None] = {}
    attrs = study_attrs or {}
    launched = set(attrs.get(LAUNCH_IDS_ATTR) or [])
    for t in waiting:
        # Its try ran under a worker's own --set values, no launch's: no relaunch "without
        # the change" helps; a worker with those values finishes it.
        cid = t.user_attrs.get(CONFIG_ID_ATTR)
        own = bool(cid) and cid not in launched and f"{CONFIG_OF_ATTR}{cid}" in attrs
        text = (trial_config_yaml(study_attrs, t) if study_attrs else None) or stored
        if text not in parsed:
            try:
                parsed[text] = config_from_yaml(text, f"study {cfg.name}")
            except ConfigError:  # an older version's config: the trainer judges the checkpoint
                parsed[text] = None
        before_cfg = parsed[text]
        if before_cfg is None or not before_cfg.trainer.checkpoint:  # none was written
            continue
        path = Path(str(t.user_attrs["checkpoint"]))
        # Where the failed try ran (a retry of an older version may carry its "host")
        ran_on = t.system_attrs.get(ATTR_FAILED_HOST) or t.user_attrs.get("host")
        if ran_on == host and path.is_absolute() and not path.exists():
            continue  # its try died before its first save: it trains from epoch 1
        try:
            before, now = before_cfg.resolve_params(t.params), cfg.resolve_params(t.params)
        except ConfigError:
            continue
        changed = [k for k in HPARAM_NAMES if getattr(before, k) != getattr(now, k)]
        if changed:
            name = changed[0]
            way = (
                "a worker with --set values of its own trained it: finish it with one "
                f"(hpsearch worker --study {cfg.name} --set trainer.defaults.{name}="
                f"{set_value(getattr(before, name))}), or start a study under another `name`"
                if own
                else "relaunch without the change until it has finished, or start a study "
                "under another `name`"
            )
            raise ConfigError(
                f"{cfg.source or cfg.name}: {name}: {getattr(now, name)!r}: trial {t.number} "
                f"waits to resume from a checkpoint trained with {getattr(before, name)!r}, "
                f"which it would refuse: {way}"
            )
        # A retry keeps its params (`retry_params`): one the space has gained since would
        # be drawn for it anew, and its checkpoint was trained without it.
        if (new := undrawn(cfg, t.params)) is not None:
            # (a custom trainer's own name has no default here)
            was = f"{new} {getattr(before, new)!r}" if new in HPARAM_NAMES else f"no {new}"
            raise ConfigError(
                f"{cfg.source or cfg.name}: search_space.{new}: trial {t.number} waits to "
                f"resume from a checkpoint trained with {was}; a new value would be drawn for "
                "it, which that checkpoint would refuse: relaunch without the change until it "
                "has finished, or start a study under another `name`"
            )
        # Its checkpoint's best val_acc was taken the old way: the new epochs' would be
        # compared with it, and its run would log eval settings its best did not have.
        if evals := _eval_changes(before_cfg, cfg, before, now):
            way = (
                "a worker with --set values of its own trained it: finish it with one given "
                f"the same (hpsearch worker --study {cfg.name} --set ...)"
                if own
                else "relaunch without the change until it has finished"
            )
            raise ConfigError(
                f"{cfg.source or cfg.name}: {', '.join(new for new, _ in evals)}: trial "
                f"{t.number} waits to resume from a checkpoint whose best was evaluated "
                f"{' and '.join(old for _, old in evals)}, which the new epochs' would be "
                f"compared with: {way}, or start a study under another `name`"
            )
        # Anything else that shapes its training (its lr schedule's length and peak, its
        # images, its model): the trainer would go on from the checkpoint otherwise
        # mid-way, and the trial's one value would be of neither config.
        if rest := [d for d in drift(cfg, before_cfg) if not _within(d[0], RESUMABLE_FIELDS)]:
            key, now_value, was = rest[0]
            way = (
                "a worker with --set values of its own trained it: finish it with one given "
                f"the same (hpsearch worker --study {cfg.name} --set {key}={set_value(was)})"
                if own
                else "relaunch without the change until it has finished"
            )
            raise ConfigError(
                f"{cfg.source or cfg.name}: {key}: {now_value!r}: trial {t.number} waits to "
                f"resume from a checkpoint trained with {was!r}, and would go on with the new "
                f"value mid-way: {way}, or start a study under another `name`"
            )


# Fields that a trial waiting to resume may go on under when changed (`check_retries_fit`):
# a limit or stopping rule, not how an epoch trains; the epoch budget (stopped, then
# relaunched to train longer: its schedule is stretched from the resumed step on, which
# the launch says); or ones checked apart (the resolved hyperparameters, the eval
# settings, the objective).
RESUMABLE_FIELDS = (
    "budget.max_epochs", "budget.trial_timeout_s", "trainer.patience", "trainer.eval_every",
    "trainer.defaults", "trainer.eval_scale", "trainer.eval_flip", "dataset.eval_limit",
    "objective",
)  # fmt: skip


def set_value(value: Any) -> str:
    """`value` as a `--set key=value` takes it (YAML: `null`, not Python's `None`; a list or
    mapping in flow style)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=2**16).strip()
    return text.removesuffix("...").strip()


def undrawn(cfg: StudyConfig, params: Mapping[str, Any]) -> str | None:
    """The first parameter of `cfg`'s search space that a trial holding `params` would draw
    anew (absent from them, its `when` holding), walked in file order as `suggest` does."""
    held: dict[str, Any] = {}
    for name, spec in cfg.search_space.items():
        if not _when_holds(spec.when, held):
            continue
        if name not in params:
            return name
        held[name] = params[name]
    return None


def retry_params(held: Mapping[str, Any], drawn: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's params for its trainer: those `suggest` gave (`drawn`), and those it held
    before (a retry's, its failed try's) that the space's walk left out: a name removed from
    the space since, or whose `when` no longer holds. The retry trains as its try did and as
    Optuna's params say, not on the trainer's default."""
    return {**{k: v for k, v in held.items() if k not in drawn}, **drawn}


def _eval_changes(
    before_cfg: StudyConfig, cfg: StudyConfig, before: Hyperparams, now: Hyperparams
) -> list[tuple[str, str]]:
    """(what is new, what it was) for each way a trial's evaluation differs between two
    configs: its size (from trainer.eval_scale or the image size), its mirror, its images."""
    out: list[tuple[str, str]] = []
    (_, was), (size, will) = before_cfg.trial_sizes(before), cfg.trial_sizes(now)  # px
    if was != will:
        scale = cfg.trainer.eval_scale
        name = (
            f"trainer.eval_scale: {scale:g}"
            if scale != before_cfg.trainer.eval_scale
            else f"dataset.image_size: {size}"
        )
        out.append((f"{name} (evaluated at {will} px)", f"at {was} px"))
    if before_cfg.trainer.eval_flip != cfg.trainer.eval_flip:
        out.append((f"trainer.eval_flip: {cfg.trainer.eval_flip}",
                    f"with eval_flip {before_cfg.trainer.eval_flip}"))  # fmt: skip
    if before_cfg.dataset.eval_limit != cfg.dataset.eval_limit:  # images; None: all
        out.append((f"dataset.eval_limit: {cfg.dataset.eval_limit}",
                    f"on eval_limit {before_cfg.dataset.eval_limit}"))  # fmt: skip
    return out


def _space_text(dist: BaseDistribution) -> str:
    if isinstance(dist, CategoricalDistribution):
        return f"choices {list(dist.choices)}"
    if isinstance(dist, FloatDistribution | IntDistribution):
        kind = "float" if isinstance(dist, FloatDistribution) else "int"
        return f"{kind} {dist.low}..{dist.high}" + (" log" if dist.log else "")
    return repr(dist)


def suggest(trial: optuna.Trial, cfg: StudyConfig) -> dict[str, Any]:
    """Sample the search space in file order; conditional params only when their `when` holds."""
    params: dict[str, Any] = {}
    for name, spec in cfg.search_space.items():
        if not _when_holds(spec.when, params):
            continue
        if isinstance(spec, FloatParam):
            params[name] = trial.suggest_float(
                name, spec.low, spec.high, log=spec.log, step=spec.step
            )
        elif isinstance(spec, IntParam):
            params[name] = trial.suggest_int(
                name, spec.low, spec.high, step=spec.step, log=spec.log
            )
        else:
            params[name] = trial.suggest_categorical(name, spec.choices)
    return params


def _when_holds(when: Mapping[str, Any] | None, params: Mapping[str, Any]) -> bool:
    """Whether a conditional parameter applies: each name in its `when` has (one of) the
    value(s) given, among the params drawn before it."""
    return not when or all(
        params.get(k) in (v if isinstance(v, list) else [v]) for k, v in when.items()
    )


FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def best_of(
    trials: Sequence[FrozenTrial], direction: optuna.study.StudyDirection
) -> FrozenTrial | None:
    """The best completed trial of a single-objective study; of tied ones the earliest, as
    `hpsearch best` and `load_best_model` rank them (Optuna's `best_trial` on PostgreSQL
    takes any of them: the study run's ONNX could be another trial's model)."""
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    return min(done, key=rank_key(direction), default=None)


def rank_key(direction: optuna.study.StudyDirection) -> Callable[[FrozenTrial], tuple[float, int]]:
    """Sort key of completed single-objective trials, best first; ties: the earlier."""
    sign = 1.0 if direction == optuna.study.StudyDirection.MINIMIZE else -1.0
    return lambda t: (sign * float(t.value or 0.0), t.number)


def budget_counts(trials: Sequence[FrozenTrial]) -> dict[str, int]:
    counts = {s.name.lower(): 0 for s in TrialState}
    for t in trials:
        counts[t.state.name.lower()] += 1
    return counts


def counts_once_requeued(counts: dict[str, int], held: int) -> dict[str, int]:
    """The counts once `held` RUNNING trials of dead workers are failed and queued again
    (the launcher holds them while the MLflow server starts): each is a waiting retry then,
    or, with no retries left, a failure, which frees its place in the budget either way."""
    moved = min(max(held, 0), counts.get("running", 0))
    out = dict(counts)
    out["running"] = counts.get("running", 0) - moved
    out["waiting"] = counts.get("waiting", 0) + moved
    return out


def may_start_trial(counts: dict[str, int], n_trials: int) -> bool:
    """True if a worker may ask for another trial.

    A WAITING trial (an enqueued retry) is always taken: it replaces a failed one. Otherwise
    finished and running trials together must stay under the study's `n_trials`; failed
    trials do not count, since their retries take their place.
    """
    if counts.get("waiting", 0) > 0:
        return True
    used = counts.get("complete", 0) + counts.get("pruned", 0) + counts.get("running", 0)
    return used < n_trials


def budget_done(counts: dict[str, int], n_trials: int) -> bool:
    """True when the study's results are final: `n_trials` completed or pruned, and nothing
    running or queued (a queued retry, or a running trial that may fail and be retried,
    can still change them)."""
    if counts.get("running", 0) or counts.get("waiting", 0):
        return False
    return counts.get("complete", 0) + counts.get("pruned", 0) >= n_trials


def objective_values(
    cfg: StudyConfig, best_val_acc: float | None, best_val_loss: float | None, train_seconds: float
) -> list[float] | None:
    """The values told to Optuna, one per objective metric; None when one is missing."""
    table = {"val_acc": best_val_acc, "val_loss": best_val_loss, "train_seconds": train_seconds}
    values = [table[m] for m in cfg.objective.metrics]
    if any(v is None for v in values):
        return None
    return [float(v) for v in values if v is not None]


def pareto_front(trials: Sequence[FrozenTrial], directions: Sequence[str]) -> list[FrozenTrial]:
    """The completed trials no other completed trial dominates (a multi-objective study's
    best, as Optuna's `best_trials`), ordered by the first objective, best first (ties: the
    earlier trial). `directions`: "maximize" or "minimize", one per objective."""
    done = [
        t
        for t in trials
        if t.state == TrialState.COMPLETE
        and t.values is not None
        and len(t.values) == len(directions)
    ]
    front = [t for t in done if not any(dominates(o.values, t.values, directions) for o in done)]
    sign = -1.0 if directions[0] == "maximize" else 1.0
    return sorted(front, key=lambda t: (sign * t.values[0], t.number))


def dominates(a: Sequence[float], b: Sequence[float], directions: Sequence[str]) -> bool:
    """Whether objective values `a` Pareto-dominate `b`: no worse in every objective and
    better in one. `directions`: "maximize" or "minimize", one per objective."""
    if not (len(a) == len(b) == len(directions)):
        raise ValueError(f"dominates: {len(a)}, {len(b)} values for {len(directions)} objectives")
    better = False
    for x, y, d in zip(a, b, directions, strict=True):
        if d == "maximize":
            x, y = -x, -y  # compare as minimization
        if x > y:
            return False
        better = better or x < y
    return better


Callback = Callable[[optuna.Study, FrozenTrial], None]
