"""`FastReadRDBStorage` reads trials in one statement; it must give exactly what Optuna's
own RDBStorage gives, for every kind of value a trial can hold, on the real PostgreSQL."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from hpsearch.rdb_reads import FastReadRDBStorage, trials_where
from hpsearch.storage import normalize_url, open_storage, resolve_storage
from optuna.distributions import (
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

INF = float("inf")


def _comparable(t: FrozenTrial) -> dict[str, Any]:
    """A trial's fields with nan made comparable (nan != nan) and param types kept."""

    def fix(v: Any) -> Any:
        return "nan" if isinstance(v, float) and math.isnan(v) else v

    d = dict(vars(t))
    d["intermediate_values"] = {k: fix(v) for k, v in t.intermediate_values.items()}
    d["_values"] = [fix(v) for v in t.values] if t.values is not None else None
    d["param_types"] = {k: type(v).__name__ for k, v in t.params.items()}
    d["param_order"] = list(t.params)
    return d


def _fill(study: optuna.Study) -> None:
    """Trials in every state, with every kind of param, value and attribute."""
    dists = {
        "lr": FloatDistribution(1e-5, 1.0, log=True),
        "drop": FloatDistribution(-1.0, 1.0),
        "stepped": FloatDistribution(0.0, 1.0, step=0.25),
        "bs": IntDistribution(8, 256, log=True),
        "layers": IntDistribution(1, 9, step=2),
        "arch": CategoricalDistribution(["resnet18", "resnet34", None, 3, 2.5, True]),
    }
    params: list[dict[str, Any]] = [
        {"lr": 0.1 + 0.2, "drop": -0.0, "stepped": 0.75, "bs": 64, "layers": 3, "arch": None},
        {"lr": 1 / 3, "drop": 1.0, "stepped": 0.0, "bs": 8, "layers": 9, "arch": 2.5},
        {"arch": True, "lr": 1e-5},  # another order, fewer params
        {},
    ]
    for i, p in enumerate(params):
        study.add_trial(
            optuna.trial.create_trial(
                params=p,
                distributions={k: dists[k] for k in p},
                value=[0.5, INF, -INF, 1e-300][i],
                intermediate_values={0: 0.25, 1: float("nan"), 2: INF, 3: -INF, 10: -1.5e12},
                user_attrs={"höst": "gpu-0", "hist": [{"epoch": 1, "acc": 0.5}], "n": i},
                system_attrs={"fixed_params": {"lr": 0.01}, "x": None},
            )
        )
    for state in (TrialState.PRUNED, TrialState.FAIL):
        t = study.ask({"lr": dists["lr"], "arch": dists["arch"]})
        t.report(0.5, 0)
        study.tell(t, state=state)
    running = study.ask({"lr": dists["lr"]})
    running.report(0.125, 4)
    running.set_user_attr("worker", "w1")
    study.enqueue_trial({"lr": 0.02})  # WAITING


@pytest.fixture
def away_from_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time 5.5 h from UTC: Optuna stores naive UTC and hands out naive local time."""
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("away_from_utc")
def test_reads_match_optuna_for_every_kind_of_trial(pg_url: str, tmp_path: Path) -> None:
    optuna_storage = RDBStorage(normalize_url(pg_url))
    study = optuna.create_study(storage=optuna_storage, study_name="twin")
    _fill(study)
    multi = optuna.create_study(
        storage=optuna_storage, study_name="multi", directions=["minimize", "maximize"]
    )
    multi.add_trial(optuna.trial.create_trial(values=[INF, -2.5]))
    multi.add_trial(optuna.trial.create_trial(values=[0.1, -INF]))
    other = optuna.create_study(storage=optuna_storage, study_name="empty")

    fast = open_storage(resolve_storage(pg_url, tmp_path))
    assert isinstance(fast, FastReadRDBStorage) and fast._fast_reads()
    sid, mid = study._study_id, multi._study_id
    all_ids = [t._trial_id for t in study.get_trials()]
    first_ids = sorted(all_ids)[:3]
    filters: list[tuple[Any, set[int], int]] = [
        (None, set(), -1),
        ([TrialState.COMPLETE, TrialState.PRUNED], set(), -1),
        ((TrialState.RUNNING,), set(), -1),
        (None, {first_ids[0], first_ids[2]}, first_ids[2]),  # included ids and newer ones
        (None, {first_ids[0], 10**9}, first_ids[1]),  # an id above the bound is not included
        (None, set(), first_ids[1]),
        ([TrialState.WAITING], {first_ids[0]}, first_ids[2]),
    ]
    for states, included, greater in filters:
        want = optuna_storage._get_trials(sid, states, included, greater)
        got = fast._get_trials(sid, states, included, greater)
        assert [_comparable(t) for t in got] == [_comparable(t) for t in want], (states, greater)
        assert want, (states, included, greater)  # each filter selects something
    for study_id in (mid, other._study_id):
        want = optuna_storage._get_trials(study_id, None, set(), -1)
        assert [_comparable(t) for t in fast._get_trials(study_id, None, set(), -1)] == [
            _comparable(t) for t in want
        ]
    for trial_id in all_ids:
        assert _comparable(fast.get_trial(trial_id)) == _comparable(
            optuna_storage.get_trial(trial_id)
        )
    with pytest.raises(KeyError):
        fast._get_trials(10**6, None, set(), -1)
    with pytest.raises(KeyError):
        fast.get_trial(10**6)

    # Through Optuna's cache, as the worker reads: the same trials, and a sampler runs on them.
    cached = optuna.load_study(study_name="twin", storage=fast)
    assert [_comparable(t) for t in cached.get_trials()] == [
        _comparable(t) for t in study.get_trials()
    ]
    cached.sampler = optuna.samplers.TPESampler(seed=0)
    cached.optimize(lambda t: t.suggest_float("lr", 1e-5, 1.0, log=True), n_trials=3)
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 7


def test_the_filter_selects_as_optunas_own() -> None:
    where, params = trials_where([TrialState.PRUNED], {5, 9, 20}, 9)
    assert (
        where == "TRUE AND t.state::text = ANY(:states) AND "
        "(t.trial_id = ANY(:included) OR t.trial_id > :greater_than)"
    )
    assert params == {"states": ["PRUNED"], "included": [5, 9], "greater_than": 9}
    assert trials_where(None, {3}, -1) == ("TRUE", {})
    assert trials_where(None, set(), 4) == (
        "TRUE AND t.trial_id > :greater_than",
        {"greater_than": 4},
    )


def test_other_databases_take_optunas_own_reads(tmp_path: Path) -> None:
    storage = FastReadRDBStorage(f"sqlite:///{tmp_path / 'o.db'}")
    assert not storage._fast_reads()
    study = optuna.create_study(storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert [t.state for t in storage.get_all_trials(study._study_id)] == [TrialState.COMPLETE] * 2
    assert sa.inspect(storage.engine).has_table("trials")
