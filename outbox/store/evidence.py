"""What the database holds of outcomes whose COMMIT was lost.

The dispatcher writes a batch of outcomes and its next claim in one transaction. When
that COMMIT fails, the database may have applied it all the same (the connection cut
after the server committed). The outcomes are then written again alone, and that write
finds the leases already released, so it writes nothing: without looking, the log and
the summary would call outcomes "not applied" that the database has. The evidence is
the attempt row: its request ID belongs to this attempt alone, and an outcome written
by anyone else (the next claim closing an expired lease) differs in delivery and
error class.

The claim's own COMMIT can be lost the same way: then its operations are leased to
this dispatcher, with open attempt rows, although it never learnt of them. They were
never sent; :func:`claim_left_open` finds them so they can be given back at once rather
than wait out their lease and be recorded as maybe applied.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select

from outbox.model import State
from outbox.store.base import Store
from outbox.store.records import AttemptOutcome, OpenAttempt
from outbox.store.tables import attempts, operations


def outcomes_applied(store: Store, outcomes: Sequence[AttemptOutcome]) -> set[int]:
    """The operations (pks) of ``outcomes`` whose attempt row is finished with exactly
    that outcome: delivery, verdict, status code and error class."""
    if not outcomes:
        return set()
    wanted = {out.request_id: out for out in outcomes}
    with store.read() as conn:
        rows = conn.execute(
            select(
                attempts.c.request_id, attempts.c.delivery, attempts.c.verdict,
                attempts.c.status_code, attempts.c.error_class,
            ).where(attempts.c.request_id.in_(list(wanted)), attempts.c.finished_at.is_not(None))
        ).all()  # fmt: skip
    applied = set()
    for request_id, delivery, verdict, status_code, error_class in rows:
        out = wanted[request_id]
        if (delivery, verdict, status_code, error_class) == (
            out.delivery.value, out.verdict.value if out.verdict else None,
            out.status_code, out.error_class,
        ):  # fmt: skip
            applied.add(out.pk)
    return applied


def claim_left_open(store: Store, token: str) -> list[OpenAttempt]:
    """What a claim whose COMMIT was reported failed holds if it took effect after all:
    the operations still leased under ``token``, in flight, with their open attempt
    rows. The dispatcher never sent them (it had no answer to start from)."""
    with store.read() as conn:
        rows = conn.execute(
            select(
                attempts.c.operation_pk, attempts.c.request_id,
                operations.c.maybe_delivered, operations.c.saw_refusal,
            )
            .join(operations, operations.c.id == attempts.c.operation_pk)
            .where(
                operations.c.state == State.IN_FLIGHT.value,  # an index's prefix
                operations.c.lease_token == token,
                attempts.c.lease_token == token,
                attempts.c.delivery.is_(None),  # open, as the outcome update has it
            )
        ).all()  # fmt: skip
    return [
        OpenAttempt(r.operation_pk, token, r.request_id, bool(r.maybe_delivered),
                    bool(r.saw_refusal))
        for r in rows
    ]  # fmt: skip
