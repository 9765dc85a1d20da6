"""The store's transactions for dispatchers: claim a batch under a lease, commit its
attempt rows, write outcomes, settle or give back what cannot be sent.

Every write is fenced on the claim's lease token: a dispatcher that lost its lease
changes nothing. A base of :class:`~outbox.store.base.Store`, which supplies the
transactions and the dialect's claim statement.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Unpack

from sqlalchemy import Connection, bindparam, func, insert, update
from sqlalchemy.sql.elements import ColumnElement

from outbox.base.fields import from_row
from outbox.model import Delivery, PolicySnapshot, State
from outbox.store._sqlalchemy import returning_count
from outbox.store.fairness import caps_json, next_cursor
from outbox.store.records import (
    AttemptLease,
    AttemptOutcome,
    BatchClaimArgs,
    Claimed,
    ClaimPlan,
    ClaimResult,
    Recovered,
    Settlement,
    StartedAttempt,
)
from outbox.store.rows import headers_text, policy_columns, stored_headers
from outbox.store.sealing import PLAIN, Sealer
from outbox.store.statements import (
    _ATTEMPT_OUTCOME,
    INSERT_ATTEMPTS,
    BatchStatements,
    OutcomeShape,
    _outcome_update,
    batch_statements,
    outcome_shape,
)
from outbox.store.tables import attempts, operations


def attempt_outcome_params(out: AttemptOutcome) -> dict[str, Any]:
    """The parameters of the UPDATE closing ``out``'s attempt row
    (:func:`~outbox.store.statements.attempt_outcome_update`) but ``b_now``."""
    return {
        "b_rid": out.request_id,
        "b_delivery": out.delivery.value,
        "b_verdict": out.verdict.value if out.verdict else None,
        "b_counted": out.counted,
        "b_status": out.status_code,
        "b_rrid": out.receiver_request_id,
        "b_eclass": out.error_class,
        "b_emsg": out.error_message,
        "b_duration": out.duration_ms,
    }


def _attempt_row(pk: int, number: int, request_id: str, lease: AttemptLease) -> dict[str, Any]:
    """What every new attempt row says: whose attempt it is, which, by whom, under
    which lease, since and until when."""
    return {
        "operation_pk": pk,
        "number": number,
        "request_id": request_id,
        "dispatcher_id": lease.owner,
        "lease_token": lease.token,
        "started_at": lease.now_ms,
        "lease_until": lease.lease_until,
    }


def claimed_from_row(r: Any, sealer: Sealer = PLAIN) -> Claimed:
    """A claimed row (:data:`DispatchQueries._CLAIMED_COLUMNS`, in that order) as
    :class:`Claimed`: by position, sealed columns opened, the stored headers decoded. A
    row this dispatcher cannot open (its key missing) carries the problem, and is not
    sent: the dispatcher puts it back with that reason, as it does a corrupt one."""
    raw_headers, body, raw, problem = sealer.for_sending(r[1], r[2], r[6], r[7], r[19])
    headers, corrupt = stored_headers(raw_headers)
    return Claimed(
        r[0], r[1], r[2], r[3], r[4], r[5], headers, body, r[8], r[9], bool(r[10]),
        bool(r[11]), r[12], r[13], r[14], r[15], r[16], r[17], r[18], problem or corrupt, raw,
        r[20],
    )  # fmt: skip


#: ``steady_ms`` of a caller whose clock is not watched for steps: any expired lease.
_ANY_LEASE = 2**62

#: How many columns a claimed row that carries its round and rotation place before
#: "was" (PostgreSQL's claim) has past the ``_CLAIMED_COLUMNS``: rn, pos, was.
_PLACED_EXTRA = 3


class DispatchQueries:
    """The dispatcher's transactions; :class:`~outbox.store.base.Store` mixes them in."""

    tenant_caps: dict[str, int]
    tenant_cursor: str
    sealer: Sealer

    def write(self) -> AbstractContextManager[Connection]:
        raise NotImplementedError

    def _snapshot_policies_on(self, conn: Connection, policies: dict[int, PolicySnapshot]) -> int:
        """Fill the policy snapshot of operations that have none (rows older than
        snapshots); a snapshot already there is never overwritten."""
        return sum(
            conn.execute(
                update(operations)
                .where(operations.c.id == pk, operations.c.policy_window_ms.is_(None))
                .values(policy_columns(policy))
            ).rowcount
            for pk, policy in policies.items()
        )

    def _pks_in(self, column: ColumnElement[Any], name: str) -> ColumnElement[bool]:
        """``column`` is one of the keys passed as parameter ``name`` (given by
        :meth:`_pks_value`): an expanding IN, unless the dialect has a fixed-shape form."""
        return column.in_(bindparam(name, expanding=True))

    def _pks_value(self, pks: Iterable[int]) -> Any:
        return list(pks)

    @functools.cached_property
    def _batch(self) -> BatchStatements:
        return batch_statements(self._pks_in)

    def _claim_statement(self) -> Any:
        """The dialect's claim: an UPDATE ... RETURNING :data:`_CLAIMED_COLUMNS` (then,
        where the dialect can say it, the state before the claim as ``was``), setting
        :data:`~outbox.store.statements.CLAIM_VALUES`; parameters ``now_ms`` and
        ``limit`` and those of the values. Built once per store (``_claim_built``)."""
        raise NotImplementedError

    @functools.cached_property
    def _claim_built(self) -> tuple[Any, bool]:
        # The statement and whether its rows carry "was" (its last column).
        statement = self._claim_statement()
        return statement, returning_count(statement) > len(self._CLAIMED_COLUMNS)

    #: In the order of :class:`Claimed`'s fields (``claimed_from_row`` relies on it).
    _CLAIMED_COLUMNS = (
        operations.c.id,
        operations.c.tenant,
        operations.c.operation_id,
        operations.c.endpoint,
        operations.c.method,
        operations.c.path,
        operations.c.headers,
        operations.c.body,
        operations.c.attempts_counted,
        operations.c.attempts_total,
        operations.c.maybe_delivered,
        operations.c.saw_refusal,
        operations.c.first_attempt_at,
        operations.c.window_started_at,
        operations.c.lease_until,
        operations.c.created_at,
        operations.c.traceparent,
        operations.c.attempts_in_progress,
        operations.c.policy_window_ms,
        operations.c.body_raw,
        operations.c.deliver_within_ms,
    )
    #: The length of a claimed row that carries its round and rotation place.
    _placed = len(_CLAIMED_COLUMNS) + _PLACED_EXTRA

    def claim(
        self, *, owner: str, token: str, now_ms: int, lease_ms: int, limit: int,
        server_clock: bool = False, steady_ms: int | None = None,
    ) -> tuple[list[Claimed], list[Recovered]]:  # fmt: skip
        """Take up to ``limit`` due operations under a new lease, in one short transaction.

        Operations whose previous lease expired are taken too; their open attempts are
        closed as ``unknown`` in the same transaction. Leases are judged and written by
        ``now_ms``, or with ``server_clock`` by the database server's clock where it has
        one (PostgreSQL); an expired lease longer than ``steady_ms`` (how long the
        caller's clock has run without a step) is not taken over. See
        DESIGN-NOTES "Leases that survive a clock step".
        """
        with self.write() as conn:
            now_ms = self._claim_clock(conn, now_ms, server_clock)
            return self._claim_on(conn, owner=owner, token=token, now_ms=now_ms,
                                  lease_ms=lease_ms, limit=limit, steady_ms=steady_ms)  # fmt: skip

    def claim_and_begin(self, **claim: Unpack[BatchClaimArgs]) -> ClaimResult:
        """Claim a batch and commit its attempt rows in the same transaction.

        ``plan`` (pure, no I/O) decides about the claimed rows inside the transaction:
        which to send (an attempt row each), which to settle or give back, which need a
        policy snapshot. One COMMIT writes all of it, so an attempt row is never
        visible without its claim, and a write refused anywhere before the COMMIT leaves
        neither: the rows stay due. (After a COMMIT whose answer was lost, nothing is
        sent either; the attempts it may have written are closed at the lease's end.)
        """
        with self.write() as conn:
            return self._claim_and_begin_on(conn, **claim)

    def record_and_claim(
        self, *, outcomes: Sequence[AttemptOutcome], **claim: Unpack[BatchClaimArgs]
    ) -> tuple[set[int], ClaimResult]:
        """``record_outcomes`` then ``claim_and_begin``, in one transaction (one COMMIT
        where there were two). The outcomes are fenced exactly as on their own; if any
        part fails, none of it is written."""
        with self.write() as conn:
            written = self._record_on(conn, now_ms=claim["now_ms"], outcomes=outcomes)
            result = self._claim_and_begin_on(conn, **claim)
        return written, result

    def _claim_and_begin_on(
        self,
        conn: Connection,
        *,
        owner: str,
        token: str,
        now_ms: int,
        lease_ms: int,
        limit: int,
        plan: Callable[[list[Claimed]], ClaimPlan],
        statement: Any = None,
        extra: dict[str, Any] | None = None,
        server_clock: bool = False,
        steady_ms: int | None = None,
    ) -> ClaimResult:
        # ``plan`` judges windows by the caller's clock; the leases, the attempts and
        # what is settled or given back here are written by the claim's own time.
        now_ms = self._claim_clock(conn, now_ms, server_clock)
        claimed, recovered = self._claim_on(
            conn, owner=owner, token=token, now_ms=now_ms, lease_ms=lease_ms, limit=limit,
            statement=statement, extra=extra, steady_ms=steady_ms,
        )  # fmt: skip
        if not claimed:
            return ClaimResult([], [], ClaimPlan(), [], set())
        decided = plan(claimed)
        if decided.policies:
            self._snapshot_policies_on(conn, decided.policies)
        for r in decided.releases:
            self._release_on(conn, token=token, now_ms=now_ms, pks=r.pks,
                             delay_ms=r.delay_ms, last_error=r.last_error)  # fmt: skip
        settled = self._settle_on(conn, now_ms=now_ms, settlements=decided.settlements)
        lease = AttemptLease(owner, token, now_ms, lease_until=now_ms + lease_ms)
        started = self._begin_on(conn, lease, decided.send)
        return ClaimResult(claimed, recovered, decided, started, settled)

    def _claim_on(
        self, conn: Connection, *, owner: str, token: str, now_ms: int, lease_ms: int, limit: int,
        statement: Any = None, extra: dict[str, Any] | None = None,
        steady_ms: int | None = None,
    ) -> tuple[list[Claimed], list[Recovered]]:
        # ``statement``/``extra``: another claim of the same shape and its parameters
        # (the half-open probe's, outbox.store.endpoints). ``now_ms``: the claim's own
        # time (``_claim_clock``, which also prepared the transaction).
        until = now_ms + lease_ms
        built, has_was = self._claim_built
        cursor = self.tenant_cursor
        params: dict[str, Any] = {
            "now_ms": now_ms, "limit": limit, "c_token": token, "c_owner": owner,
            "c_until": until, "c_now": now_ms,
            "steady_ms": _ANY_LEASE if steady_ms is None else steady_ms,
        }  # fmt: skip
        if statement is None:  # the fair claim: its rotation and per-tenant limits
            params.update(cursor=cursor, caps=caps_json(self.tenant_caps))
            params.update(self._takeover_params(conn, now_ms, steady_ms))
        rows = conn.execute(built if statement is None else statement,
                            {**params, **(extra or {})}).all()  # fmt: skip
        if not rows:
            return [], []
        claimed = [claimed_from_row(r, self.sealer) for r in rows]
        if statement is None:
            # Where the rows carry their round and rotation place (PostgreSQL), by them.
            places = [(r[-3], r[-2]) for r in rows] if len(rows[0]) >= self._placed else None
            self.tenant_cursor = next_cursor([c.tenant for c in claimed], places, cursor)
        # Only a row taken over from an expired lease can have an open attempt. A
        # dialect whose claim cannot say what the row was (no "was" column) checks all.
        in_flight = State.IN_FLIGHT.value
        taken_over = [r[0] for r in rows if not has_was or r[-1] == in_flight]
        recovered = self._close_open_attempts(conn, taken_over, now_ms) if taken_over else []
        if recovered:
            flagged = {r.pk for r in recovered}
            claimed = [replace(c, maybe_delivered=True) if c.pk in flagged else c for c in claimed]
        return claimed, recovered

    def _before_claim(self, conn: Connection) -> None:
        """A dialect's preparation of the claim's transaction (nothing by default)."""

    def _takeover_params(
        self, conn: Connection, now_ms: int, steady_ms: int | None
    ) -> dict[str, Any]:
        """A dialect's further parameters of the fair claim's takeover rule (none)."""
        return {}

    def _claim_clock(self, conn: Connection, now_ms: int, server_clock: bool) -> int:
        """Prepare the claim's transaction (``_before_claim``) and return the time its
        leases are judged and written by: ``now_ms``, unless ``server_clock`` asks for
        the database server's clock and the dialect has one (PostgreSQL's override)."""
        self._before_claim(conn)
        return now_ms

    def _close_open_attempts(
        self, conn: Connection, pks: Sequence[int], now_ms: int
    ) -> list[Recovered]:
        batch = self._batch
        rows = conn.execute(
            batch.close_open, {"b_ids": self._pks_value(pks), "b_now": now_ms}
        ).all()
        if rows:
            flagged = self._pks_value([r.operation_pk for r in rows])
            conn.execute(batch.flag_maybe, {"b_ids": flagged})
        return [from_row(Recovered, r, pk=r.operation_pk) for r in rows]

    def begin_attempts(
        self,
        *,
        token: str,
        owner: str,
        now_ms: int,
        lease_until: int,
        request_ids: dict[int, str],
    ) -> list[StartedAttempt]:
        """Commit the attempt rows of a batch before any of them is sent.

        Fenced on the lease token: an operation another dispatcher took over gets no
        attempt and must not be sent.
        """
        if not request_ids:
            return []
        with self.write() as conn:
            lease = AttemptLease(owner, token, now_ms, lease_until)
            return self._begin_on(conn, lease, request_ids)

    def _begin_on(
        self, conn: Connection, lease: AttemptLease, request_ids: dict[int, str]
    ) -> list[StartedAttempt]:
        if not request_ids:
            return []
        rows = conn.execute(
            self._batch.begin,
            {"b_ids": self._pks_value(request_ids), "b_token": lease.token, "b_now": lease.now_ms},
        ).all()
        started = [
            StartedAttempt(
                pk=r.id,
                request_id=request_ids[r.id],
                number=r.attempts_total,
                first_attempt_at=r.first_attempt_at,
                window_started_at=r.window_started_at,
            )
            for r in rows
        ]
        if started:
            self._insert_attempts_on(conn, lease, started)
        return started

    def _insert_attempts_on(
        self, conn: Connection, lease: AttemptLease, started: Sequence[StartedAttempt]
    ) -> None:
        """The open attempt rows of ``started`` (one INSERT executed per row; a dialect
        may write them in one statement)."""
        rows = [_attempt_row(s.pk, s.number, s.request_id, lease) for s in started]
        conn.execute(INSERT_ATTEMPTS, rows)

    def record_outcomes(self, *, now_ms: int, outcomes: Sequence[AttemptOutcome]) -> set[int]:
        """Write attempt outcomes and transitions; returns the operations written.

        Each write is fenced on the lease token: if another dispatcher has taken the
        operation over, neither the attempt nor the operation changes. One transaction
        per batch: a fencing read (row-locked on PostgreSQL, and the write lock is already
        held on SQLite), then one prepared UPDATE per kind of transition, executed for all
        of its rows at once.
        """
        if not outcomes:
            return set()
        with self.write() as conn:
            return self._record_on(conn, now_ms=now_ms, outcomes=outcomes)

    def _record_on(
        self, conn: Connection, *, now_ms: int, outcomes: Sequence[AttemptOutcome]
    ) -> set[int]:
        if not outcomes:
            return set()
        pks = self._pks_value([out.pk for out in outcomes])
        held = dict(conn.execute(self._batch.fence, {"b_ids": pks}).all())
        mine = [out for out in outcomes if held.get(out.pk) == out.lease_token]
        if not mine:
            return set()
        self._write_outcomes_on(conn, now_ms=now_ms, mine=mine)
        return {out.pk for out in mine}

    def _write_outcomes_on(
        self, conn: Connection, *, now_ms: int, mine: Sequence[AttemptOutcome]
    ) -> None:
        """Write outcomes whose lease the fencing read found held (the rows locked):
        per kind of transition, one prepared UPDATE executed for each of its rows, in
        the order of the first outcome of each kind; then the attempts, in order."""
        groups: dict[OutcomeShape, list[dict[str, Any]]] = {}
        for out in mine:
            params = {**self._outcome_params(out), "b_now": now_ms}
            groups.setdefault(outcome_shape(out), []).append(params)
        for shape, rows in groups.items():
            conn.execute(_outcome_update(*shape), rows)
        rows = [{**attempt_outcome_params(out), "b_now": now_ms} for out in mine]
        conn.execute(_ATTEMPT_OUTCOME, rows)

    def _outcome_params(self, out: AttemptOutcome) -> dict[str, Any]:
        """The parameters of ``out``'s operation UPDATE (:func:`outcome_update`) but
        ``b_now``: its fence, its transition and, if any, its result, sealed."""
        params: dict[str, Any] = {
            "b_pk": out.pk,
            "b_token": out.lease_token,
            "b_state": out.state.value,
            "b_reason": out.reason.value if out.reason else None,
            "b_next": out.next_attempt_at,
            "b_maybe": out.maybe_delivered,
            "b_refusal": out.saw_refusal,
        }
        if out.result is not None:
            sealed = self.sealer.seal_result(
                out.pk,
                {
                    "result_headers": headers_text(out.result.headers),
                    "result_body": out.result.body,
                },
            )
            params.update(
                b_rstatus=out.result.status,
                b_rheaders=sealed["result_headers"],
                b_rbody=sealed["result_body"],
                b_rsha=out.result.sha256,
                b_rsize=out.result.size,
                b_rtrunc=out.result.truncated,
            )
        return params

    def _settle_on(
        self, conn: Connection, *, now_ms: int, settlements: Sequence[Settlement]
    ) -> set[int]:
        written: set[int] = set()
        for s in settlements:
            values: dict[str, Any] = {
                "state": s.state.value,
                "reason": s.reason.value if s.reason else None,
                "last_error": s.last_error,
                "next_attempt_at": None,
                "lease_token": None,
                "lease_owner": None,
                "lease_until": None,
                "updated_at": now_ms,
                "finished_at": now_ms,
            }
            if s.not_sent is not None:
                values["attempts_total"] = operations.c.attempts_total + 1
            row = conn.execute(
                update(operations)
                .where(operations.c.id == s.pk, operations.c.lease_token == s.lease_token)
                .values(values)
                .returning(operations.c.attempts_total)
            ).first()
            if row is None:
                continue
            written.add(s.pk)
            if s.not_sent is not None:
                error_class, message, request_id, owner = s.not_sent
                lease = AttemptLease(owner, s.lease_token, now_ms, lease_until=now_ms)
                conn.execute(
                    insert(attempts).values(
                        **_attempt_row(s.pk, row.attempts_total, request_id, lease),
                        finished_at=now_ms,
                        delivery=Delivery.NOT_SENT.value,
                        counted=False,
                        error_class=error_class,
                        error_message=message,
                        duration_ms=0,
                    )
                )
        return written

    def release(
        self,
        *,
        token: str,
        now_ms: int,
        pks: Sequence[int],
        delay_ms: int = 0,
        last_error: str | None = None,
    ) -> int:
        """Give back claimed operations without an attempt, due again after ``delay_ms``.

        ``last_error`` says why they could not be sent (shown to operators, counted by
        ``status``); it is cleared by the next attempt. With it, the retry window starts
        now if it has not started: an operation no dispatcher can send still ends.
        """
        if not pks:
            return 0
        with self.write() as conn:
            return self._release_on(conn, token=token, now_ms=now_ms, pks=pks,
                                    delay_ms=delay_ms, last_error=last_error)  # fmt: skip

    def _release_on(
        self,
        conn: Connection,
        *,
        token: str,
        now_ms: int,
        pks: Sequence[int],
        delay_ms: int,
        last_error: str | None,
    ) -> int:
        extra: dict[str, Any] = {}
        if last_error is not None:
            extra = {
                "last_error": last_error,
                "window_started_at": func.coalesce(operations.c.window_started_at, now_ms),
            }
        return conn.execute(
            update(operations)
            .where(operations.c.id.in_(list(pks)), operations.c.lease_token == token)
            .values(
                state=State.PENDING.value,
                **extra,
                next_attempt_at=now_ms + delay_ms,
                lease_token=None,
                lease_owner=None,
                lease_until=None,
                updated_at=now_ms,
            )
        ).rowcount


__all__ = ["DispatchQueries"]
