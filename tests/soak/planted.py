"""Run ``outbox`` with one planted bug, to prove that the soak's oracle can fail.

``OUTBOX_SOAK_PLANT=<bug> python -m tests.soak.planted --app tests.soak.app:outbox dispatch``

The bugs are monkeypatches of outbox internals in this process only; the library's
source is never changed. ``install(bug, setattr_)`` applies one in-process too (pass
pytest's ``monkeypatch.setattr`` so it is undone after the test).

* ``key_per_attempt``: the Idempotency-Key is the request ID (a new key per attempt).
* ``send_before_commit``: the attempt row is written after the response instead of
  before the send (it is deleted in the claim's transaction, right after it is written,
  and written back with the outcome), so a crash in between leaves a request with no attempt.
* ``no_window_check``: the retry window (and the key-retention cap) never closes.
* ``no_lease_check``: no re-check of the lease before sending.
* ``no_fencing``: outcome writes ignore the lease token (the writer takes the row back).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection, delete, insert, update

import outbox.dispatch._attempt
from outbox.config import Endpoint
from outbox.dispatch.dispatcher import Dispatcher
from outbox.store.base import Store
from outbox.store.records import AttemptOutcome, ClaimResult
from outbox.store.tables import attempts, operations
from outbox.wire.transport import request_headers

PLANT_ENV = "OUTBOX_SOAK_PLANT"
Setter = Callable[[Any, str, Any], None]


def _key_per_attempt(set_: Setter) -> None:
    def planted(endpoint: Endpoint, **kwargs: Any) -> dict[str, str]:
        name = endpoint.idempotency_header.lower()
        headers = {k: v for k, v in request_headers(endpoint, **kwargs).items()
                   if k.lower() != name}  # fmt: skip
        headers[endpoint.idempotency_header] = kwargs["request_id"]
        return headers

    set_(outbox.dispatch._attempt, "request_headers", planted)


def _send_before_commit(set_: Setter) -> None:
    original_claim = Store._claim_and_begin_on
    original_record = Store._record_on
    deferred: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def claim(self: Store, conn: Connection, **kwargs: Any) -> ClaimResult:
        result = original_claim(self, conn, **kwargs)
        if result.started:
            ids = [s.request_id for s in result.started]
            rows = conn.execute(
                delete(attempts).where(attempts.c.request_id.in_(ids)).returning(attempts)
            ).all()
            with lock:
                for row in rows:
                    values = dict(row._mapping)
                    values.pop("id")
                    deferred[values["request_id"]] = values
        return result

    def record(
        self: Store, conn: Connection, *, now_ms: int, outcomes: Sequence[AttemptOutcome]
    ) -> set[int]:
        with lock:
            rows = [deferred.pop(o.request_id) for o in outcomes if o.request_id in deferred]
        if rows:
            conn.execute(insert(attempts), rows)
        return original_record(self, conn, now_ms=now_ms, outcomes=outcomes)

    set_(Store, "_claim_and_begin_on", claim)
    set_(Store, "_record_on", record)


def _no_window_check(set_: Setter) -> None:
    def deadline_ms(self: Endpoint, *, window_started_at_ms: int, first_attempt_at_ms: int) -> int:
        return 2**62

    set_(Endpoint, "deadline_ms", deadline_ms)


def _no_lease_check(set_: Setter) -> None:
    def lease_left(self: Dispatcher, work: Any) -> float:
        return float("inf")

    set_(Dispatcher, "_lease_left", lease_left)


def _no_fencing(set_: Setter) -> None:
    original_record = Store._record_on

    def record(
        self: Store, conn: Connection, *, now_ms: int, outcomes: Sequence[AttemptOutcome]
    ) -> set[int]:
        # The planted bug: write whatever the lease says, by taking the row back first.
        for out in outcomes:
            conn.execute(
                update(operations).where(operations.c.id == out.pk)
                .values(lease_token=out.lease_token)
            )
            conn.execute(
                update(attempts).where(attempts.c.request_id == out.request_id)
                .values(delivery=None)
            )
        return original_record(self, conn, now_ms=now_ms, outcomes=outcomes)

    set_(Store, "_record_on", record)


BUGS: dict[str, Callable[[Setter], None]] = {
    "key_per_attempt": _key_per_attempt,
    "send_before_commit": _send_before_commit,
    "no_window_check": _no_window_check,
    "no_lease_check": _no_lease_check,
    "no_fencing": _no_fencing,
}


def install(bug: str | None, set_: Setter = setattr) -> None:
    """Apply one planted bug (None or "" applies nothing)."""
    if not bug:
        return
    if bug not in BUGS:
        raise ValueError(f"unknown planted bug {bug!r}; known: {sorted(BUGS)}")
    BUGS[bug](set_)


def main() -> None:
    install(os.environ.get(PLANT_ENV))
    from outbox.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
