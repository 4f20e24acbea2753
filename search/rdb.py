"""Optuna's RDBStorage with its per-trial hot path in plain SQL on PostgreSQL.

A worker makes a few dozen storage calls per trial, and Optuna's RDBStorage makes each
through its ORM: several statements and a commit, each a round trip, and an ORM object
built per row read. With 32 workers on two cores that CPU is what limits trials/s, and the
round trips under the study lock are what the other askers queue behind
(docs/performance.md, `py-spy --gil`).

`FastRDBStorage` does these on PostgreSQL in plain SQL on Optuna's own tables, the same
rows Optuna would write or read, and leaves everything else to Optuna:

- **Reading trials** (`_get_trials`, which Optuna's cache calls to re-read the running
  trials and fetch new ones, and `get_trial`): one statement. Each trial's child rows
  (params, values, attributes, intermediate values) come back as ordered JSON arrays,
  which the driver decodes in C; Optuna's ORM makes one query per child table and builds
  an object per row. Distributions are parsed once per distinct JSON text.
- **Creating a trial** (no template; a retry's template trial is Optuna's): the study row
  locked as Optuna locks it, then one insert that numbers the trial as Optuna does. Under
  the study (budget) lock, on the lock's own connection, in the transaction of the budget
  count (`budget_lock_held`).
- **Heartbeats**: one upsert.
- **Finishing a trial** (`set_trial_state_values` to COMPLETE, PRUNED or FAIL: the tell):
  one statement that locks the trial, checks it is not finished, writes its values and
  state. Moving a waiting trial to RUNNING (a retry's claim) is Optuna's, after the
  trial's first heartbeat.
- **An intermediate value**: one upsert, written only while the trial is not finished.
- **A running trial's params and attributes** (`write_running_trial`, which
  `hpsearch.storage.set_trial_attrs` uses): one statement that locks the trial, checks it
  is not finished (Optuna's rule for every write to a trial) and writes all rows.

`tests/search/test_rdb.py` checks each against Optuna's own on the real PostgreSQL. Other
databases, a database at an Optuna schema revision this SQL was not written for, and an
Optuna release it was not checked against (`KNOWN_OPTUNA`) take Optuna's own methods
throughout.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import threading
from collections.abc import Container, Iterable, Iterator, Sequence
from functools import lru_cache
from typing import Any

import optuna
import sqlalchemy as sa
from optuna import distributions
from optuna.distributions import BaseDistribution
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.orm import Session

try:  # Optuna's internals: where a release moves them, every method is Optuna's own
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    INTERNALS_MISSING: str | None = None
except ImportError as _exc:
    INTERNALS_MISSING = str(_exc)

# Optuna's KeyError text for a missing study or trial (`models.NOT_FOUND_MSG`).
NOT_FOUND_MSG = "Record does not exist."

logger = logging.getLogger(__name__)

# The alembic revisions of Optuna's schema whose tables this SQL was written for (Optuna's
# `RDBStorage` refuses a database that is not at its own head revision).
SCHEMA_REVISIONS = ("v3.2.0.a",)
# The Optuna releases whose writes this SQL was checked against: the revision alone does
# not say how a release fills the rows (5.1 changed its models and the revision stayed).
# tests/search/test_rdb.py compares every statement with 5.1's own; 5.0's models and write
# paths differ from 5.1's in type annotations only. Others take Optuna's own methods.
KNOWN_OPTUNA = ("5.0", "5.1")


def optuna_known(version: str) -> bool:
    """Whether this SQL was checked against Optuna `version`'s own writes."""
    return ".".join(version.split(".")[:2]) in KNOWN_OPTUNA


# One row per trial; each child table aggregated in its own ordered JSON array. Floats
# travel as their text form, which is what the driver parses for the ORM too (so -0.0 and
# whole numbers stay floats). The ORM orders params by `param_id` (their order in
# `FrozenTrial.params`) and values by objective; attributes and intermediate values are
# dicts, so their order does not matter.
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
    (SELECT json_agg(json_build_array(i.step, i.intermediate_value::text,
                                      i.intermediate_value_type)
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

# Optuna takes this row lock before numbering a new trial; Optuna's own creations (a
# retry's template trial, `enqueue_trial`) and these exclude each other with it.
_LOCK_STUDY_SQL = "SELECT study_id FROM studies WHERE study_id = :study_id FOR UPDATE"

# A statement of its own after the lock, so that its snapshot sees every trial committed
# before the lock was granted. A trial's number is the count of the study's trials with a
# smaller id (Optuna's `count_past_trials`): all of them, as ids only grow.
_CREATE_TRIAL_SQL = """
INSERT INTO trials (number, study_id, state, datetime_start)
VALUES ((SELECT count(*) FROM trials WHERE study_id = :study_id), :study_id, 'RUNNING', :start)
RETURNING trial_id, number
"""

# Optuna inserts the first heartbeat with the column's default (CURRENT_TIMESTAMP) and
# sets later ones to now(): the same transaction timestamp.
_HEARTBEAT_SQL = """
INSERT INTO trial_heartbeats (trial_id, heartbeat) VALUES (:trial_id, CURRENT_TIMESTAMP)
ON CONFLICT (trial_id) DO UPDATE SET heartbeat = EXCLUDED.heartbeat
"""

# Optuna's rule for every write to a trial (`check_trial_is_updatable`): not finished.
_UNFINISHED = "state IN ('RUNNING', 'WAITING')"

# The trial as `t`, locked unless it is finished: a concurrent tell waits for this
# transaction, so nothing lands on a trial finished meanwhile, and a statement built on it
# writes only while `t` has its row.
_LOCKED_UNFINISHED_TRIAL = f"""
t AS (SELECT trial_id FROM trials WHERE trial_id = :trial_id AND {_UNFINISHED} FOR UPDATE)
"""

# Every row of a running trial's params and attributes, only if it is not finished. A param
# row that exists already is kept: a commit whose reply a dropped connection lost is
# retried, and Optuna never writes a trial's param twice otherwise. Params get their ids
# in the order drawn: that is their order in `FrozenTrial.params`.
_WRITE_RUNNING_SQL = f"""
WITH {_LOCKED_UNFINISHED_TRIAL}, p AS (
    INSERT INTO trial_params (trial_id, param_name, param_value, distribution_json)
    SELECT t.trial_id, n, v, d
    FROM t, unnest(CAST(:p_names AS text[]), CAST(:p_values AS float8[]),
                   CAST(:p_dists AS text[])) WITH ORDINALITY AS r(n, v, d, i)
    ORDER BY i
    ON CONFLICT (trial_id, param_name) DO NOTHING
), u AS (
    INSERT INTO trial_user_attributes (trial_id, key, value_json)
    SELECT t.trial_id, k, v FROM t, unnest(CAST(:u_keys AS text[]), CAST(:u_values AS text[]))
        AS r(k, v)
    ON CONFLICT (trial_id, key) DO UPDATE SET value_json = EXCLUDED.value_json
), s AS (
    INSERT INTO trial_system_attributes (trial_id, key, value_json)
    SELECT t.trial_id, k, v FROM t, unnest(CAST(:s_keys AS text[]), CAST(:s_values AS text[]))
        AS r(k, v)
    ON CONFLICT (trial_id, key) DO UPDATE SET value_json = EXCLUDED.value_json
)
SELECT count(*) FROM t
"""

# Values as Optuna stores them (`TrialValueModel.value_to_stored_repr`). The PostgreSQL enum
# types are the ones SQLAlchemy names after Optuna's enum classes.
_FINISH_SQL = f"""
WITH {_LOCKED_UNFINISHED_TRIAL}, v AS (
    INSERT INTO trial_values (trial_id, objective, value, value_type)
    SELECT t.trial_id, o, v, CAST(vt AS trialvaluetype)
    FROM t, unnest(CAST(:objectives AS int[]), CAST(:values AS float8[]),
                   CAST(:value_types AS text[])) AS r(o, v, vt)
    ON CONFLICT (trial_id, objective)
        DO UPDATE SET value = EXCLUDED.value, value_type = EXCLUDED.value_type
)
UPDATE trials SET state = CAST(:state AS trialstate), datetime_complete = :complete
FROM t WHERE trials.trial_id = t.trial_id
RETURNING trials.trial_id
"""

# Optuna reads the trial (no lock) and writes only while it is not finished.
_INTERMEDIATE_SQL = f"""
INSERT INTO trial_intermediate_values
    (trial_id, step, intermediate_value, intermediate_value_type)
SELECT trial_id, :step, :value, CAST(:value_type AS trialintermediatevaluetype)
FROM trials WHERE trial_id = :trial_id AND {_UNFINISHED}
ON CONFLICT (trial_id, step) DO UPDATE SET
    intermediate_value = EXCLUDED.intermediate_value,
    intermediate_value_type = EXCLUDED.intermediate_value_type
RETURNING trial_id
"""

_TRIAL_STATE_SQL = "SELECT state FROM trials WHERE trial_id = :trial_id"

# A param's distribution as the study first stored it (Optuna's compatibility check).
_STUDY_DISTRIBUTION_SQL = """
SELECT p.distribution_json FROM trial_params p JOIN trials t ON t.trial_id = p.trial_id
WHERE t.study_id = :study_id AND p.param_name = :name LIMIT 1
"""

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


# Per thread, the connection holding the study (budget) lock, by the engine it came from:
# the trial that the locked section creates is inserted there (`budget_lock_held`).
_budget_locks = threading.local()


@contextlib.contextmanager
def budget_lock_held(conn: sa.Connection) -> Iterator[None]:
    """While this thread holds the study lock on `conn` (a session-level advisory lock),
    `FastRDBStorage` on `conn`'s engine creates trials on `conn`, in the transaction that
    counted the budget there, and commits it.

    The lock lives only as long as its database session. Were the trial inserted on
    another connection, a restart between the count and the insert would end the lock
    unnoticed: another worker would take it, count and create, and this insert, on a new
    connection, would still go through, past the budget. On the lock's own session the
    insert fails with the lock, and the count it relied on goes with it."""
    held: dict[sa.Engine, sa.Connection] = _budget_locks.__dict__.setdefault("held", {})
    engine = conn.engine
    outer = held.get(engine)  # a section nested on the same engine (not done today)
    held[engine] = conn
    try:
        yield
    finally:
        if outer is None:
            held.pop(engine, None)
        else:
            held[engine] = outer


def _budget_lock_connection(engine: sa.Engine) -> sa.Connection | None:
    held: dict[sa.Engine, sa.Connection] = getattr(_budget_locks, "held", {})
    return held.get(engine)


def _insert_trial(
    db: sa.Connection | Session, study_id: int, start: datetime.datetime
) -> tuple[int, int]:
    """A new RUNNING trial of the study, numbered as Optuna does: (trial id, number)."""
    if db.execute(sa.text(_LOCK_STUDY_SQL), {"study_id": study_id}).first() is None:
        raise KeyError(NOT_FOUND_MSG)
    trial_id, number = db.execute(
        sa.text(_CREATE_TRIAL_SQL), {"study_id": study_id, "start": start}
    ).one()
    return int(trial_id), int(number)


def _insert_trial_under_lock(
    conn: sa.Connection, study_id: int, start: datetime.datetime, beat: bool = False
) -> tuple[int, int]:
    """`_insert_trial` on the study lock's connection, committed with the budget count
    before it, and with the trial's first heartbeat when `beat` (heartbeats on): a commit
    whose reply is lost leaves no RUNNING trial without one, which no stale check would
    ever find. Errors as Optuna's session gives them: an integrity error as it is, other
    database errors as StorageInternalError. The transaction is left to the lock's
    release, which rolls it back."""
    try:
        created = _insert_trial(conn, study_id, start)
        if beat:
            conn.execute(sa.text(_HEARTBEAT_SQL), {"trial_id": created[0]})
        conn.commit()
    except sa.exc.IntegrityError:
        raise
    except sa.exc.SQLAlchemyError as exc:
        raise optuna.exceptions.StorageInternalError(
            f"creating a trial under the study lock failed: {exc!r}"
        ) from exc
    return created


class FastRDBStorage(RDBStorage):
    """`RDBStorage` whose per-trial hot path is plain SQL on PostgreSQL (module
    docstring). Construct it as `RDBStorage`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        known = optuna_known(optuna.__version__)
        self._fast = (
            self.engine.name == "postgresql"
            and INTERNALS_MISSING is None
            and known
            and self.get_current_version() in SCHEMA_REVISIONS
        )
        if self.engine.name == "postgresql" and INTERNALS_MISSING is not None:
            logger.warning(
                "this Optuna (%s) lacks the internals hpsearch's fast storage path uses (%s): "
                "using Optuna's own RDBStorage methods",
                optuna.__version__,
                INTERNALS_MISSING,
            )
        elif self.engine.name == "postgresql" and not known:
            logger.warning(
                "hpsearch's fast storage path was checked against Optuna %s, not %s: "
                "using Optuna's own RDBStorage methods",
                " and ".join(KNOWN_OPTUNA),
                optuna.__version__,
            )

    def fast_sql(self) -> bool:
        """True where this class's SQL is used: PostgreSQL, at a schema revision it knows."""
        return self._fast

    def get_trial(self, trial_id: int) -> FrozenTrial:
        if not self.fast_sql():
            return super().get_trial(trial_id)
        with _create_scoped_session(self.scoped_session) as session:
            row = session.execute(sa.text(_ONE_TRIAL_SQL), {"trial_id": trial_id}).first()
        if row is None:
            raise KeyError(NOT_FOUND_MSG)
        return frozen_trial_from_row(row)

    def _get_trials(
        self,
        study_id: int,
        states: Container[TrialState] | None,
        included_trial_ids: set[int],
        trial_id_greater_than: int,
    ) -> list[FrozenTrial]:
        if not self.fast_sql():
            return super()._get_trials(study_id, states, included_trial_ids, trial_id_greater_than)
        where, params = trials_where(states, included_trial_ids, trial_id_greater_than)
        with _create_scoped_session(self.scoped_session) as session:
            rows = session.execute(
                sa.text(_STUDY_TRIALS_SQL.format(where=where)), {"study_id": study_id, **params}
            ).all()
        if not rows:
            raise KeyError(NOT_FOUND_MSG)
        return [frozen_trial_from_row(row) for row in rows if row[0] is not None]

    def _create_new_trial(
        self, study_id: int, template_trial: FrozenTrial | None = None
    ) -> FrozenTrial:
        if template_trial is not None or not self.fast_sql():
            return super()._create_new_trial(study_id, template_trial)
        # Optuna's `datetime.now()`, stored as naive UTC; handed back as read back.
        start = datetime.datetime.now().astimezone(datetime.UTC).replace(tzinfo=None)
        # No retry here, unlike Optuna's: a lost connection may have taken the study lock
        # with it (a session lock), and another worker may since have taken it, counted
        # and created; only a re-run of the whole locked section, count included, may
        # create (the caller's `with_db_retry`). PostgreSQL reports a deadlock as an
        # OperationalError too, which that retry also runs again whole.
        lock_conn = _budget_lock_connection(self.engine)
        if lock_conn is None:
            with _create_scoped_session(self.scoped_session) as session:
                trial_id, number = _insert_trial(session, study_id, start)
        else:
            beat = getattr(self, "heartbeat_interval", None) is not None
            trial_id, number = _insert_trial_under_lock(lock_conn, study_id, start, beat)
        return FrozenTrial(
            number=number,
            state=TrialState.RUNNING,
            value=None,
            values=None,
            datetime_start=_local_naive(start),
            datetime_complete=None,
            params={},
            distributions={},
            user_attrs={},
            system_attrs={},
            intermediate_values={},
            trial_id=trial_id,
        )

    def beats_on_create(self) -> bool:
        """Whether `create_new_trial`, called now, writes the trial's first heartbeat in
        its own commit (under the study lock, heartbeats on): the caller need not."""
        return (
            self.fast_sql()
            and getattr(self, "heartbeat_interval", None) is not None
            and _budget_lock_connection(self.engine) is not None
        )

    def beats_on_claim(self) -> bool:
        """Whether moving a queued trial to RUNNING records its heartbeat first (heartbeats
        on): the caller need not."""
        return self.get_heartbeat_interval() is not None

    def record_heartbeat(self, trial_id: int) -> None:
        if not self.fast_sql():
            super().record_heartbeat(trial_id)
            return
        # As Optuna: an integrity error (the trial deleted meanwhile) is ignored.
        with _create_scoped_session(self.scoped_session, True) as session:
            session.execute(sa.text(_HEARTBEAT_SQL), {"trial_id": trial_id})

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        if state == TrialState.RUNNING and self.get_heartbeat_interval() is not None:
            # A queued retry's claim (Optuna's WAITING -> RUNNING) and its first heartbeat
            # are two commits. Beat first: a worker that dies after the claim's commit, or
            # whose reply to it is lost (its retried ask then claims another trial), leaves
            # a RUNNING trial that the stale check finds, not one without a heartbeat that
            # no check ever finds. A beat on a trial still waiting, or taken by another
            # worker meanwhile, is harmless: stale checks read RUNNING trials only.
            self.record_heartbeat(trial_id)
        if not (self.fast_sql() and state.is_finished()):
            return super().set_trial_state_values(trial_id, state, values)
        stored = [models.TrialValueModel.value_to_stored_repr(v) for v in values or ()]
        # Optuna's `datetime.now()`, stored as naive UTC.
        complete = datetime.datetime.now().astimezone(datetime.UTC).replace(tzinfo=None)
        try:
            with _create_scoped_session(self.scoped_session) as session:
                done = session.execute(
                    sa.text(_FINISH_SQL),
                    {
                        "trial_id": trial_id,
                        "objectives": list(range(len(stored))),
                        "values": [value for value, _ in stored],
                        "value_types": [value_type.name for _, value_type in stored],
                        "state": state.name,
                        "complete": complete,
                    },
                ).first()
                if done is None:
                    self._raise_not_running(session, trial_id)
        except sa.exc.IntegrityError:  # as Optuna
            return False
        return True

    def set_trial_intermediate_value(
        self, trial_id: int, step: int, intermediate_value: float
    ) -> None:
        if not self.fast_sql():
            super().set_trial_intermediate_value(trial_id, step, intermediate_value)
            return
        value, value_type = models.TrialIntermediateValueModel.intermediate_value_to_stored_repr(
            intermediate_value
        )
        params = {"trial_id": trial_id, "step": step, "value": value}
        # As Optuna: an integrity error (two writers of one step at once) is ignored.
        with _create_scoped_session(self.scoped_session, True) as session:
            written = session.execute(
                sa.text(_INTERMEDIATE_SQL), {**params, "value_type": value_type.name}
            ).first()
            if written is None:
                self._raise_not_running(session, trial_id)

    def _raise_not_running(self, session: Any, trial_id: int) -> None:
        """Optuna's error for a write to a trial that is not running: KeyError for no such
        trial, else `UpdateFinishedTrialError`."""
        state = session.execute(sa.text(_TRIAL_STATE_SQL), {"trial_id": trial_id}).scalar()
        if state is None:
            raise KeyError(NOT_FOUND_MSG)
        self.check_trial_is_updatable(trial_id, TrialState[state])
        raise RuntimeError(f"trial {trial_id} is {state}, but was not written")

    def write_running_trial(
        self,
        trial_id: int,
        study_id: int,
        params: Sequence[tuple[str, float, BaseDistribution]],
        user_attrs: dict[str, Any],
        system_attrs: dict[str, Any],
        known: dict[str, BaseDistribution],
    ) -> None:
        """Params (name, internal value, distribution) and attributes of a running trial,
        in one transaction of one statement; nothing is written to a finished trial
        (Optuna's `UpdateFinishedTrialError` then, or KeyError for no trial).

        A param name keeps a compatible distribution across the study, as Optuna checks:
        against `known` (this process's view of the study's distributions), else against
        the study's first stored use of the name. Only where `fast_sql()`."""
        if not self.fast_sql():
            raise RuntimeError("write_running_trial needs PostgreSQL and a known Optuna schema")
        with _create_scoped_session(self.scoped_session, True) as session:
            for name, _, distribution in params:
                previous = known.get(name)
                if previous is None:  # first use of this name in this process: ask the study
                    stored = session.execute(
                        sa.text(_STUDY_DISTRIBUTION_SQL), {"study_id": study_id, "name": name}
                    ).scalar()
                    if stored is not None:
                        previous = distributions.json_to_distribution(stored)
                if previous is not None:
                    distributions.check_distribution_compatibility(previous, distribution)
            written = session.execute(
                sa.text(_WRITE_RUNNING_SQL),
                {
                    "trial_id": trial_id,
                    "p_names": [name for name, _, _ in params],
                    "p_values": [float(internal) for _, internal, _ in params],
                    "p_dists": [distributions.distribution_to_json(d) for _, _, d in params],
                    "u_keys": list(user_attrs),
                    "u_values": [json.dumps(v) for v in user_attrs.values()],
                    "s_keys": list(system_attrs),
                    "s_values": [json.dumps(v) for v in system_attrs.values()],
                },
            ).scalar()
            if not written:
                self._raise_not_running(session, trial_id)
