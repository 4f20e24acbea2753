"""Optuna's RDBStorage with its trial reads made in one statement on PostgreSQL.

Every worker re-reads the other workers' trials many times a trial: TPE, the pruner and
the budget view go through Optuna's cache, which re-reads each running trial in full
(`_get_trials`), and every read of a running trial (`get_trial`: the `Trial` built after
the ask, the tell) goes to the database. Optuna makes such a read with its ORM: one query
for the trials and one per child table (params, values, both attribute tables,
intermediate values), or a lazy load per table for one trial, then builds an ORM object
per row. With 32 workers on two cores that was a third of the workers' Python CPU, most of
it in building ORM objects (`py-spy --gil`, docs/performance.md).

`FastReadRDBStorage` reads the same rows of Optuna's own tables in one statement: each
trial's child rows come back aggregated as JSON arrays, which the driver decodes in C, and
the `FrozenTrial`s are built from them directly. Distributions are parsed once per distinct
JSON text. Everything else, writes included, is Optuna's. The result is the same as
Optuna's (`tests/search/test_storage.py` compares both on every kind of value a trial can
hold). Other databases, and an Optuna whose schema version this SQL was not written for,
take Optuna's own reads.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Container, Iterable, Sequence
from functools import lru_cache
from typing import Any

import sqlalchemy as sa
from optuna import distributions
from optuna.distributions import BaseDistribution
from optuna.storages import RDBStorage
from optuna.storages._rdb import models
from optuna.storages._rdb.storage import _create_scoped_session
from optuna.trial import FrozenTrial, TrialState

SCHEMA_VERSIONS = (12,)  # Optuna's `models.SCHEMA_VERSION`s whose tables this SQL reads

# One row per trial; each child table aggregated in its own ordered JSON array. Floats
# travel as their text form, which is what the driver parses for the ORM too (so -0.0 and
# whole numbers stay floats). The ORM
# orders params by `param_id` (their order in `FrozenTrial.params`) and values by
# objective; attributes and intermediate values are dicts, so their order does not matter.
_COLUMNS = """
    t.trial_id, t.number, t.state, t.datetime_start, t.datetime_complete,
    (SELECT json_agg(json_build_array(p.param_name, p.param_value::text, p.distribution_json)
                     ORDER BY p.param_id)
       FROM trial_params p WHERE p.trial_id = t.trial_id),
    (SELECT json_agg(json_build_array(v.objective, v.value::text, v.value_type)
                     ORDER BY v.objective)
       FROM trial_values v WHERE v.trial_id = t.trial_id),
    (SELECT json_agg(json_build_array(a.key, a.value_json)
                     ORDER BY a.trial_user_attribute_id)
       FROM trial_user_attributes a WHERE a.trial_id = t.trial_id),
    (SELECT json_agg(json_build_array(a.key, a.value_json)
                     ORDER BY a.trial_system_attribute_id)
       FROM trial_system_attributes a WHERE a.trial_id = t.trial_id),
    (SELECT json_agg(json_build_array(i.step, i.intermediate_value::text, i.intermediate_value_type)
                     ORDER BY i.step)
       FROM trial_intermediate_values i WHERE i.trial_id = t.trial_id)
"""

# `studies` first, so that a study with no matching trials gives one row of NULLs and a
# missing study none (Optuna raises KeyError for it).
_STUDY_TRIALS_SQL = f"""
SELECT {_COLUMNS}
FROM studies s LEFT JOIN trials t ON t.study_id = s.study_id AND {{where}}
WHERE s.study_id = :study_id
ORDER BY t.trial_id
"""

_ONE_TRIAL_SQL = f"SELECT {_COLUMNS} FROM trials t WHERE t.trial_id = :trial_id"

# The stored forms of +-inf and nan (Optuna keeps the value NULL and says which in a type
# column; its enums are stored by name).
_SPECIAL = {"INF_POS": float("inf"), "INF_NEG": float("-inf"), "NAN": float("nan")}


def trials_where(
    states: Container[TrialState] | None,
    included_trial_ids: set[int],
    trial_id_greater_than: int,
) -> tuple[str, dict[str, Any]]:
    """The trial filter of Optuna's `_get_trials`, as SQL and its parameters: the given
    states, and trials that are in `included_trial_ids` (those up to
    `trial_id_greater_than`) or newer than `trial_id_greater_than`."""
    clauses = ["TRUE"]
    params: dict[str, Any] = {}
    if states is not None:
        if not isinstance(states, Iterable):
            raise TypeError(f"states must be iterable, got {type(states).__name__}")
        clauses.append("t.state::text = ANY(:states)")
        params["states"] = [TrialState(s).name for s in states]
    included = sorted(i for i in included_trial_ids if i <= trial_id_greater_than)
    if included and trial_id_greater_than > -1:
        clauses.append("(t.trial_id = ANY(:included) OR t.trial_id > :greater_than)")
        params.update(included=included, greater_than=trial_id_greater_than)
    elif trial_id_greater_than > -1:
        clauses.append("t.trial_id > :greater_than")
        params["greater_than"] = trial_id_greater_than
    return " AND ".join(clauses), params


@lru_cache(maxsize=1024)
def _distribution(distribution_json: str) -> BaseDistribution:
    # A study has a few distinct distributions, shared by all its trials; distributions
    # are not changed after they are built, so trials may share one object.
    return distributions.json_to_distribution(distribution_json)


def _local_naive(utc_naive: datetime.datetime | None) -> datetime.datetime | None:
    # Optuna stores naive UTC and hands out naive local time (models.TrialModel).
    if utc_naive is None:
        return None
    return utc_naive.replace(tzinfo=datetime.UTC).astimezone().replace(tzinfo=None)


def _number(value: str | None, stored_type: str) -> float:
    if stored_type == "FINITE":
        if value is None:
            raise ValueError("a FINITE value stored as NULL")
        return float(value)
    return _SPECIAL[stored_type]


def frozen_trial_from_row(row: Sequence[Any]) -> FrozenTrial:
    """A `FrozenTrial` as Optuna's `_build_frozen_trial_from_trial_model` builds it, from
    one row of `_COLUMNS`."""
    trial_id, number, state, start, complete, params, vals, user, system, inter = row
    values: list[float] | None = None
    if vals:
        values = [0.0] * len(vals)
        for objective, value, stored_type in vals:
            values[objective] = _number(value, stored_type)
    dists = {name: _distribution(dist_json) for name, _, dist_json in params or ()}
    return FrozenTrial(
        number=number,
        state=TrialState[state],
        value=None,
        values=values,
        datetime_start=_local_naive(start),
        datetime_complete=_local_naive(complete),
        params={
            name: dists[name].to_external_repr(float(value)) for name, value, _ in params or ()
        },
        distributions=dists,
        user_attrs={key: json.loads(value_json) for key, value_json in user or ()},
        system_attrs={key: json.loads(value_json) for key, value_json in system or ()},
        intermediate_values={
            step: _number(value, stored_type) for step, value, stored_type in inter or ()
        },
        trial_id=trial_id,
    )


class FastReadRDBStorage(RDBStorage):
    """`RDBStorage` whose `get_trial` and `_get_trials` are one statement each on
    PostgreSQL (module docstring). Construct it as `RDBStorage`."""

    def _fast_reads(self) -> bool:
        return self.engine.name == "postgresql" and models.SCHEMA_VERSION in SCHEMA_VERSIONS

    def get_trial(self, trial_id: int) -> FrozenTrial:
        if not self._fast_reads():
            return super().get_trial(trial_id)
        with _create_scoped_session(self.scoped_session) as session:
            row = session.execute(sa.text(_ONE_TRIAL_SQL), {"trial_id": trial_id}).first()
        if row is None:
            raise KeyError(models.NOT_FOUND_MSG)
        return frozen_trial_from_row(row)

    def _get_trials(
        self,
        study_id: int,
        states: Container[TrialState] | None,
        included_trial_ids: set[int],
        trial_id_greater_than: int,
    ) -> list[FrozenTrial]:
        if not self._fast_reads():
            return super()._get_trials(study_id, states, included_trial_ids, trial_id_greater_than)
        where, params = trials_where(states, included_trial_ids, trial_id_greater_than)
        with _create_scoped_session(self.scoped_session) as session:
            rows = session.execute(
                sa.text(_STUDY_TRIALS_SQL.format(where=where)), {"study_id": study_id, **params}
            ).all()
        if not rows:
            raise KeyError(models.NOT_FOUND_MSG)
        return [frozen_trial_from_row(row) for row in rows if row[0] is not None]
