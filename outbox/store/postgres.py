"""PostgreSQL: claim through a materialized CTE with FOR UPDATE SKIP LOCKED; wake
dispatchers with NOTIFY from inside the enqueuing transaction (``store.changes``).

``UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)`` may be planned
so that the subquery runs more than once and locks (and returns) more rows than asked
for; a MATERIALIZED CTE runs exactly once. Any number of dispatchers on any number of
machines can claim concurrently: each skips the rows the others hold.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from psycopg.types.array import ListBinaryDumper
from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Connection,
    Integer,
    String,
    Text,
    any_,
    bindparam,
    cast,
    column,
    func,
    insert,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeDecorator, TypeEngine

from outbox.store.base import Store
from outbox.store.changes import ChangeSource, PostgresListener, notify_column
from outbox.store.dispatching import attempt_outcome_params
from outbox.store.fairness import fair_claim_sql, fair_params
from outbox.store.marker import COLUMN as MARKER_COLUMN
from outbox.store.records import AttemptLease, AttemptOutcome, StartedAttempt, TxStatus
from outbox.store.statements import (
    CLAIM_VALUES,
    OutcomeShape,
    attempt_outcome_update,
    claim_limits,
    claimable_ids,
    outcome_shape,
    outcome_update,
)
from outbox.store.tables import attempts, operations


class BinaryList(list[Any]):
    """A list psycopg sends as a binary array, on a connection :func:`send_binary_lists`
    prepared (another sends it as a text array: the same value, more slowly)."""


def send_binary_lists(conn: Connection) -> None:
    """Have psycopg send :class:`BinaryList` values on this connection as binary arrays:
    registered once per DBAPI connection (the pool forgets the mark with the connection)."""
    pooled = conn.connection
    if "outbox_binary_lists" not in pooled.info:
        driver: Any = pooled.driver_connection  # a psycopg.Connection
        driver.adapters.register_dumper(BinaryList, ListBinaryDumper)
        pooled.info["outbox_binary_lists"] = True


class BinaryArray(TypeDecorator[list[Any]]):
    """``ARRAY(item)`` whose value reaches psycopg as a :class:`BinaryList`. psycopg's
    text array format quotes each string through regular expressions (7 µs for a short
    JSON object, 48 µs per operation in a drain), the binary one copies its bytes."""

    impl = ARRAY
    cache_ok = True

    def bind_processor(self, dialect: Dialect) -> Any:
        # Instead of ARRAY's, which copies the value into a plain list.
        return BinaryList


def unnest(types: dict[str, TypeEngine[Any]]) -> Any:
    """``unnest(:a::T[], :b::U[], ...) AS v(a, b, ...)``: a row per position of the
    arrays passed as the parameters named as its columns (of one length; a None
    element is a NULL). Strings travel as TEXT[]: a cast to VARCHAR(n)[] would cut
    a longer value short where a parameter is refused."""
    arrays = [bindparam(name, type_=BinaryArray(t)) for name, t in types.items()]
    return func.unnest(*arrays).table_valued(*types).render_derived(name="v")


_OUTCOME_COLUMNS: dict[str, TypeEngine[Any]] = {
    "b_pk": BigInteger(), "b_token": Text(), "b_state": Text(), "b_reason": Text(),
    "b_next": BigInteger(), "b_maybe": Boolean(), "b_refusal": Boolean(),
}  # fmt: skip
_RESULT_COLUMNS: dict[str, TypeEngine[Any]] = {
    "b_rstatus": Integer(), "b_rheaders": Text(), "b_rbody": Text(), "b_rsha": Text(),
    "b_rsize": Integer(), "b_rtrunc": Boolean(),
}  # fmt: skip
_ATTEMPT_COLUMNS: dict[str, TypeEngine[Any]] = {
    "b_rid": Text(), "b_delivery": Text(), "b_verdict": Text(), "b_counted": Boolean(),
    "b_status": Integer(), "b_rrid": Text(), "b_eclass": Text(), "b_emsg": Text(),
    "b_duration": Integer(),
}  # fmt: skip


def _arrays(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """The per-row parameters of a batch (one name set) as one array per name."""
    return {name: [row[name] for row in rows] for name in rows[0]}


@functools.cache
def _outcomes_update(shape: OutcomeShape) -> Any:
    # The fenced UPDATE of one kind of outcome, joined to the batch's rows of that kind.
    rows = unnest(_OUTCOME_COLUMNS | (_RESULT_COLUMNS if shape[2] else {}))
    return outcome_update(shape, lambda name: rows.c[name])


def _attempts_update() -> Any:
    rows = unnest(_ATTEMPT_COLUMNS)
    return attempt_outcome_update(lambda name: rows.c[name])


def _attempts_insert() -> Any:
    rows = unnest({"b_pk": BigInteger(), "b_number": Integer(), "b_rid": Text()})
    return insert(attempts).from_select(
        ["operation_pk", "number", "request_id", "dispatcher_id", "lease_token",
         "started_at", "lease_until"],
        select(rows.c.b_pk, rows.c.b_number, rows.c.b_rid, bindparam("b_owner", type_=Text),
               bindparam("b_token", type_=Text), bindparam("b_now", type_=BigInteger),
               bindparam("b_until", type_=BigInteger)),
    )  # fmt: skip


#: ``SET LOCAL jit = off`` (see ``_before_claim``) and the server's time in epoch ms.
_PREPARE_CLAIM = text(
    "SELECT set_config('jit', 'off', true), "
    "CAST(floor(extract(epoch FROM clock_timestamp()) * 1000) AS BIGINT)"
)

_ATTEMPTS_UPDATE = _attempts_update()
_ATTEMPTS_INSERT = _attempts_insert()


class PostgresStore(Store):
    dialect = "postgresql"

    def _insert_ignoring_duplicate(self) -> Any:
        return pg_insert(operations).on_conflict_do_nothing(
            index_elements=["tenant", "operation_id"]
        )

    def _pks_in(self, column: ColumnElement[Any], name: str) -> ColumnElement[bool]:
        # = ANY(array): the same SQL text (and server-side prepared statement) for any
        # number of keys.
        return column == any_(bindparam(name, type_=ARRAY(BigInteger)))

    # -- a batch's rows in one statement each -----------------------------------------
    # psycopg's executemany (pipeline mode) spends more CPU per row than the server
    # does; one statement over arrays is executed once, whatever the batch's size.

    def _insert_attempts_on(
        self, conn: Connection, lease: AttemptLease, started: Sequence[StartedAttempt]
    ) -> None:
        send_binary_lists(conn)
        conn.execute(
            _ATTEMPTS_INSERT,
            {
                "b_pk": [s.pk for s in started],
                "b_number": [s.number for s in started],
                "b_rid": [s.request_id for s in started],
                "b_owner": lease.owner,
                "b_token": lease.token,
                "b_now": lease.now_ms,
                "b_until": lease.lease_until,
            },
        )

    def _write_outcomes_on(
        self, conn: Connection, *, now_ms: int, mine: Sequence[AttemptOutcome]
    ) -> None:
        if len({o.pk for o in mine}) < len(mine) or len({o.request_id for o in mine}) < len(mine):
            # An operation or attempt twice in one batch. No dispatcher writes that (an
            # attempt has one outcome; one of an older lease failed the fencing read), but
            # a joined UPDATE would write either row: row by row, as SQLite does.
            super()._write_outcomes_on(conn, now_ms=now_ms, mine=mine)
            return
        send_binary_lists(conn)
        groups: dict[OutcomeShape, list[AttemptOutcome]] = {}
        for out in mine:
            groups.setdefault(outcome_shape(out), []).append(out)
        for shape, outs in groups.items():
            params = _arrays([self._outcome_params(o) for o in outs])
            conn.execute(_outcomes_update(shape), {**params, "b_now": now_ms})
        params = _arrays([attempt_outcome_params(o) for o in mine])
        conn.execute(_ATTEMPTS_UPDATE, {**params, "b_now": now_ms})

    def _claim_statement(self) -> Any:
        # "was": the state before the claim, so the recovery UPDATE of open attempts
        # runs only when a row was taken over from an expired lease (a round trip saved
        # on every other claim).
        # The fair claim (store.fairness): "rn" and "pos" place each row in the
        # claim's rounds, so the next claim's rotation starts after the last served.
        due = (
            text(fair_claim_sql("postgresql"))
            .bindparams(*claim_limits(), *fair_params())
            .columns(
                operations.c.id,
                column("was", String),
                column("rn", BigInteger),
                column("pos", BigInteger),
            )
        )
        return self._claim_update(due, "rn", "pos", "was")

    @functools.cached_property
    def _probe_claim(self) -> Any:
        # The half-open probe (store.endpoints): one due row of the blocked endpoint
        # ``probe_endpoint``, outside the fair rotation.
        due = (
            claimable_ids(*claim_limits(), probe=True)
            .add_columns(operations.c.state.label("was"))
            .with_for_update(skip_locked=True, of=operations)
        )
        return self._claim_update(due, "was")

    def _claim_update(self, due: Any, *after: str) -> Any:
        """Claim the rows ``due`` selects (run once, as a MATERIALIZED CTE), returning
        the claimed columns and then ``due``'s columns named in ``after``."""
        cte = due.cte("due").prefix_with("MATERIALIZED")
        return (
            update(operations)
            .where(operations.c.id == cte.c.id)
            .values(CLAIM_VALUES)
            .returning(*self._CLAIMED_COLUMNS, *(cte.c[name] for name in after))
        )

    def _probe_claim_statement(self) -> Any:
        return self._probe_claim

    def _before_claim(self, conn: Connection) -> None:
        # The fair claim's recursive walk is estimated far above jit_above_cost, and
        # JIT compiling it took ~60 ms of a ~5 ms claim (measured: claim of 100 at 1k
        # rows, 100 ms -> 6 ms). For this transaction only; the pool's sessions keep
        # their settings.
        conn.exec_driver_sql("SET LOCAL jit = off")

    def _claim_clock(self, conn: Connection, now_ms: int, server_clock: bool) -> int:
        # Leases judged by the server's clock: read in the statement that prepares the
        # transaction (no round trip more), so no dispatcher's clock, stepped or not,
        # can make a live lease look expired or write one that is.
        if not server_clock:
            return super()._claim_clock(conn, now_ms, server_clock)
        return int(conn.execute(_PREPARE_CLAIM).one()[1])

    def server_time_ms(self) -> int | None:
        with self.read() as conn:
            value = conn.execute(
                select(func.floor(func.extract("epoch", func.clock_timestamp()) * 1000))
            ).scalar_one()
        return int(value)

    # -- change signals -----------------------------------------------------------

    def _insert_wakes(self) -> tuple[Any, ...]:
        return (notify_column(operations.c.endpoint),)

    def _signal_on(self, conn: Connection) -> None:
        conn.execute(select(notify_column(literal(""))))

    def change_source(
        self, *, application_name: str, interval: float, listen_url: str | None = None
    ) -> ChangeSource | None:
        return PostgresListener(
            self.engine, application_name=application_name, listen_url=listen_url
        )

    def _insert_marks(self) -> tuple[Any, ...]:
        # The ID the INSERT assigns its transaction anyway.
        return (cast(func.pg_current_xact_id(), Text).label(MARKER_COLUMN),)

    def commit_status(self, marker: str) -> TxStatus:
        with self.read() as conn:
            value = conn.execute(
                text("SELECT pg_xact_status(CAST(:xid AS xid8))"), {"xid": marker}
            ).scalar()
        try:
            return TxStatus(value)
        except ValueError:
            return TxStatus.UNKNOWN  # NULL: too old to be known (wrapped around)
