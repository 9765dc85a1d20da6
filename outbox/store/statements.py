"""Statements the dispatcher runs per batch, built once, and what "due" means."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    Select,
    and_,
    bindparam,
    case,
    exists,
    func,
    insert,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.expression import FromClause

from outbox.model import BLOCKING_STATES, DUE_STATES, Delivery, ErrorClass, State, state_values
from outbox.store.records import AttemptOutcome
from outbox.store.tables import attempts, endpoint_states, operations


def _states(*states: State) -> list[Any]:
    # Literal values, not bound parameters: SQLite uses a partial index only when it can
    # see that the query's WHERE implies the index's. Declaration order, as the index.
    return [literal_column(f"'{s.value}'") for s in State if s in states]


def sql_list(states: frozenset[State]) -> str:
    """``'pending', 'in_flight'``: a state set as SQL text."""
    return ", ".join(f"'{v}'" for v in state_values(states))


#: In a state a claim may take (pending, or in flight with a lease that will expire).
DUE: ColumnElement[bool] = operations.c.state.in_(_states(*DUE_STATES))


def due_at(now_ms: Any) -> ColumnElement[bool]:
    """Due at ``now_ms``: in a due state, and its ``next_attempt_at`` has come (for an
    in-flight row that is the lease's end, so an expired lease comes due by itself)."""
    return and_(DUE, operations.c.next_attempt_at <= now_ms)


def blocks(earlier: FromClause, *, tenant: Any, ordering_key: Any, pk: Any) -> ColumnElement[bool]:
    """``earlier`` (a row of the operations table) holds back the operation with this
    tenant, ordering key and primary key: an earlier operation of the same (tenant,
    ordering key) that is still pending, in flight or unresolved. The arguments are
    columns (in a claim) or values (asking about one operation)."""
    return and_(
        earlier.c.tenant == tenant,
        earlier.c.ordering_key == ordering_key,
        earlier.c.id < pk,
        earlier.c.state.in_(_states(*BLOCKING_STATES)),
    )


def endpoint_blocked() -> ColumnElement[bool]:
    """The operation's endpoint is blocked fleet-wide: its circuit is open or half open,
    or an operator paused it (``outbox.store.endpoints``). Nothing of it is claimed."""
    return exists().where(
        endpoint_states.c.name == operations.c.endpoint,
        endpoint_states.c.blocked == literal_column("1"),
    )


def claimable_ids(now_ms: Any, limit: Any, *, probe: bool = False) -> Select[Any]:
    """The ids a claim may take, oldest due first: due, and not held back by an earlier
    operation of its ordering key. The one definition: PostgreSQL's claim selects it,
    SQLite's claim is this compiled once to text (``store.sqlite``). Operations of a
    blocked endpoint are left out, except by a ``probe`` claim, which takes only those
    of the endpoint ``probe_endpoint`` (the half-open probe)."""
    earlier = operations.alias("earlier")
    blocked = exists().where(
        blocks(
            earlier,
            tenant=operations.c.tenant,
            ordering_key=operations.c.ordering_key,
            pk=operations.c.id,
        )
    )
    ids = (
        select(operations.c.id)
        .where(due_at(now_ms))
        .where(or_(operations.c.ordering_key.is_(None), ~blocked))
    )
    if probe:
        # As the fair claim: an expired lease no longer than the clock's steady time
        # (``steady_ms``, store.fairness).
        held = or_(
            operations.c.state != State.IN_FLIGHT.value,
            func.coalesce(operations.c.lease_until - operations.c.updated_at, 0)
            <= bindparam("steady_ms", type_=BigInteger),
        )
        ids = ids.where(operations.c.endpoint == bindparam("probe_endpoint"), held)
    else:
        ids = ids.where(~endpoint_blocked())
    return ids.order_by(operations.c.next_attempt_at).limit(limit)


#: What a claim sets, with the parameters ``c_token``, ``c_owner``, ``c_until`` (the
#: lease's end, when the row is next due) and ``c_now``.
CLAIM_VALUES: dict[str, Any] = {
    "state": State.IN_FLIGHT.value,
    "lease_token": bindparam("c_token"),
    "lease_owner": bindparam("c_owner"),
    "lease_until": bindparam("c_until"),
    "next_attempt_at": bindparam("c_until"),
    "version": operations.c.version + 1,
    "updated_at": bindparam("c_now"),
}


def claim_limits() -> tuple[Any, Any]:
    """The claim's ``now_ms`` and ``limit`` parameters."""
    return bindparam("now_ms", type_=BigInteger), bindparam("limit", type_=Integer)


#: A kind of attempt outcome: (counted, settled, has a result, "still processing").
OutcomeShape = tuple[bool, bool, bool, bool]

#: Where a per-row value of the outcome writes comes from, by parameter name: a bound
#: parameter (one row per execution) or a column of a set of rows (one execution per
#: batch, on PostgreSQL). ``b_now`` is always a bound parameter.
Source = Callable[[str], Any]


def outcome_shape(out: AttemptOutcome) -> OutcomeShape:
    """Which :func:`outcome_update` writes ``out``."""
    return (out.counted, out.state.is_settled, out.result is not None, out.in_progress)


def outcome_update(shape: OutcomeShape, source: Source) -> Any:
    """The fenced UPDATE of an operation for one kind of attempt outcome: the row
    ``b_pk``, only while it still holds the lease ``b_token``."""
    counted, settled, has_result, in_progress = shape
    now: Any = bindparam("b_now")
    values: dict[str, Any] = {
        "state": source("b_state"),
        "reason": source("b_reason"),
        "next_attempt_at": source("b_next"),
        "lease_token": None,
        "lease_owner": None,
        "lease_until": None,
        "maybe_delivered": source("b_maybe"),
        "saw_refusal": source("b_refusal"),
        "updated_at": now,
    }
    if not counted:
        values["attempts_counted"] = operations.c.attempts_counted - 1
    if in_progress:
        values["attempts_in_progress"] = operations.c.attempts_in_progress + 1
    if settled:
        values["finished_at"] = now
    if has_result:
        values.update(
            result_status=source("b_rstatus"),
            result_headers=source("b_rheaders"),
            result_body=source("b_rbody"),
            result_sha256=source("b_rsha"),
            result_size=source("b_rsize"),
            result_truncated=source("b_rtrunc"),
        )
    return (
        update(operations)
        .where(operations.c.id == source("b_pk"), operations.c.lease_token == source("b_token"))
        .values(values)
    )


def attempt_outcome_update(source: Source) -> Any:
    """Close the open attempt ``b_rid`` with what it observed."""
    return (
        update(attempts)
        .where(attempts.c.request_id == source("b_rid"), attempts.c.delivery.is_(None))
        .values(
            delivery=source("b_delivery"),
            verdict=source("b_verdict"),
            counted=source("b_counted"),
            status_code=source("b_status"),
            receiver_request_id=source("b_rrid"),
            error_class=source("b_eclass"),
            error_message=source("b_emsg"),
            duration_ms=source("b_duration"),
            finished_at=bindparam("b_now"),
        )
    )


_OUTCOME_UPDATES: dict[OutcomeShape, Any] = {}


def _outcome_update(counted: bool, settled: bool, has_result: bool, in_progress: bool) -> Any:
    """:func:`outcome_update` with a bound parameter per value, executed per row.

    Built once per kind and executed with parameters: building a statement with literal
    ``.values()`` per row costs SQLAlchemy more than the database spends running it.
    """
    key = (counted, settled, has_result, in_progress)
    stmt = _OUTCOME_UPDATES.get(key)
    if stmt is None:
        stmt = _OUTCOME_UPDATES[key] = outcome_update(key, bindparam)
    return stmt


_ATTEMPT_OUTCOME = attempt_outcome_update(bindparam)


#: ``column`` is one of the primary keys passed as the parameter named by the second
#: argument: a fixed-shape statement whatever the number of keys (no expanding IN to
#: render on every execution). Each store says how (``Store._pks_in``).
PksIn = Callable[[Any, str], ColumnElement[bool]]


@dataclass(frozen=True, slots=True)
class BatchStatements:
    """The statements a dispatcher runs per batch that take a list of keys, built once
    per store with its dialect's :data:`PksIn`."""

    #: The attempt counters of the operations about to be sent (``b_ids``, fenced on
    #: ``b_token``), returning what the attempt rows need.
    begin: Any
    #: The operations' lease tokens (``b_ids``), locked (FOR UPDATE) on PostgreSQL.
    fence: Any
    #: Close the open attempts of operations taken over from an expired lease.
    close_open: Any
    #: Flag operations whose open attempt was closed as maybe delivered.
    flag_maybe: Any


def batch_statements(pks_in: PksIn) -> BatchStatements:
    now = bindparam("b_now", type_=BigInteger)
    _ever_sent = or_(operations.c.maybe_delivered, operations.c.saw_refusal)
    begin = (
        update(operations)
        .where(pks_in(operations.c.id, "b_ids"), operations.c.lease_token == bindparam("b_token"))
        .values(
            attempts_total=operations.c.attempts_total + 1,
            attempts_counted=operations.c.attempts_counted + 1,
            # Never sent is not maybe applied: until an attempt may have reached the
            # receiver, each attempt starts the window (and the key's life) afresh.
            first_attempt_at=case(
                (_ever_sent, func.coalesce(operations.c.first_attempt_at, now)), else_=now
            ),
            window_started_at=case(
                (_ever_sent, func.coalesce(operations.c.window_started_at, now)), else_=now
            ),
            last_error=None,
            updated_at=now,
        )
        .returning(
            operations.c.id,
            operations.c.attempts_total,
            operations.c.first_attempt_at,
            operations.c.window_started_at,
        )
    )
    fence = (
        select(operations.c.id, operations.c.lease_token)
        .where(pks_in(operations.c.id, "b_ids"))
        .order_by(operations.c.id)
        .with_for_update()
    )
    close_open = (
        update(attempts)
        .where(pks_in(attempts.c.operation_pk, "b_ids"), attempts.c.delivery.is_(None))
        .values(
            delivery=Delivery.UNKNOWN.value,
            finished_at=now,
            error_class=ErrorClass.LEASE_EXPIRED.value,
            error_message=(
                "the dispatcher's lease expired before it recorded an outcome "
                "(it crashed, was killed or paused); the request may have been sent"
            ),
        )
        .returning(
            attempts.c.operation_pk,
            attempts.c.request_id,
            attempts.c.number,
            attempts.c.dispatcher_id,
        )
    )
    flag_maybe = (
        update(operations).where(pks_in(operations.c.id, "b_ids")).values(maybe_delivered=True)
    )
    return BatchStatements(begin=begin, fence=fence, close_open=close_open, flag_maybe=flag_maybe)


#: The attempt rows of a batch (executemany).
INSERT_ATTEMPTS = insert(attempts)
