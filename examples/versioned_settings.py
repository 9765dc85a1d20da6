"""A versioned settings integration: an expected version AND an operation ID.

The receiver keeps one settings row with a version (``automations``: interval, version).
A change carries the version it was decided against; the row changes only if that
version is still current. The outbox sends each change under its own operation ID, and
the receiver's idempotency receipt is written in the same transaction as the row change.

The two do different jobs:

* the operation ID lets a retry of a change whose response was lost get that change's
  own stored result back, even after a later edit moved the version on (a version check
  alone would refuse the retry, and the client could not tell "applied" from "conflict");
* the expected version refuses a *new* change decided against an old version (412),
  which the outbox records as ``failed``: a person re-reads and decides again.

The replayed result is history (what edit-42 did), not the current row: a client must
not overwrite what it shows with it without a fresh read.

Run:  python examples/versioned_settings.py [-v]   (exit 0 only if every check held)
"""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import structlog
from tenacity import wait_fixed

from outbox import Endpoint, Operation, Outbox, RetryPolicy, State
from outbox.testing.receiver import Receiver, Refuse

PATH = re.compile(r"/automations/(\d+)/interval")


def set_interval(
    conn: sqlite3.Connection, tenant: str, method: str, path: str, body: Any
) -> tuple[int, Any]:
    """The receiver's effect. It runs inside the transaction that stores the receipt,
    after the receipt lookup: a recognised retry never reaches the version check."""
    match = PATH.fullmatch(path)
    if method != "PUT" or match is None:
        raise Refuse(404, {"error": "not_found"})
    if (
        not isinstance(body, dict)
        or set(body) != {"expected_version", "interval_minutes"}
        or not all(type(v) is int for v in body.values())
        or not 5 <= body["interval_minutes"] <= 1440
    ):
        raise Refuse(400, {"error": "invalid_body"})
    automation = int(match[1])
    row = conn.execute(
        "UPDATE automations SET interval_minutes = ?, version = version + 1"
        " WHERE id = ? AND version = ? RETURNING id, interval_minutes, version",
        (body["interval_minutes"], automation, body["expected_version"]),
    ).fetchone()
    if row is None:
        current = conn.execute(
            "SELECT version FROM automations WHERE id = ?", (automation,)
        ).fetchone()
        if current is None:
            raise Refuse(404, {"error": "not_found"})
        # Refuse rolls back and drops the receipt: nothing of this request remains.
        raise Refuse(412, {"error": "version_conflict", "current_version": current[0]})
    return 200, {"id": row[0], "interval_minutes": row[1], "version": row[2]}


def stored_row(db: Path) -> tuple[int, int]:
    """(interval, version) read from the receiver's store: the oracle, not a response."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        interval, version = conn.execute(
            "SELECT interval_minutes, version FROM automations WHERE id = 1"
        ).fetchone()
    return int(interval), int(version)


def change(ob: Outbox, operation_id: str, expected_version: int, minutes: int) -> None:
    ob.enqueue(
        endpoint="automations",
        method="PUT",
        path="/automations/1/interval",
        json={"expected_version": expected_version, "interval_minutes": minutes},
        operation_id=operation_id,
    )


def settle(ob: Outbox, operation_id: str, timeout: float = 15.0) -> Operation:
    deadline = time.monotonic() + timeout
    while True:
        ob.dispatch_once()
        op = ob.get(operation_id)
        if op.is_settled or time.monotonic() > deadline:
            return op
        time.sleep(0.1)


def main() -> int:
    if "-v" not in sys.argv:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    checks: list[tuple[str, bool]] = []
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "settings-service.db"
        service = Receiver(db, handler=set_interval)
        with contextlib.closing(sqlite3.connect(db)) as conn:
            conn.executescript(
                "CREATE TABLE automations (id INTEGER PRIMARY KEY,"
                " interval_minutes INTEGER NOT NULL, version INTEGER NOT NULL);"
                "INSERT INTO automations VALUES (1, 15, 1);"
            )
        with service:
            ob = Outbox(
                f"sqlite:///{Path(tmp) / 'client.db'}",
                endpoints=[
                    Endpoint(
                        name="automations",
                        base_url=service.url,
                        timeout=2.0,
                        retry=RetryPolicy(max_attempts=5, window=timedelta(seconds=30),
                                          wait=wait_fixed(0.3)),
                        key_retention=timedelta(hours=1),
                    )
                ],
            )  # fmt: skip
            try:
                print(f"start: interval, version = {stored_row(db)}")

                # 1. edit-42 (version 1 -> interval 30) commits; its response is lost.
                service.faults.drop_after_commit(times=1, key="edit-42")
                change(ob, "edit-42", expected_version=1, minutes=30)
                ob.dispatch_once()
                lost = ob.get("edit-42")
                print(f"edit-42 attempt 1: {lost.attempts[0].error_class}, delivery "
                      f"{lost.attempts[0].delivery}; the client does not know the outcome; "
                      f"store now {stored_row(db)}")  # fmt: skip

                # 2. Meanwhile someone else reads version 2 and sets 60 (their own key).
                other = httpx.put(
                    f"{service.url}/automations/1/interval",
                    json={"expected_version": 2, "interval_minutes": 60},
                    headers={"Idempotency-Key": "web-ui-edit-43"},
                )
                print(f"web-ui-edit-43: {other.status_code} {other.json()}")

                # 3. The outbox retries edit-42: same operation ID, new request ID.
                edit42 = settle(ob, "edit-42")
                result = edit42.result
                print(f"edit-42 attempt {edit42.attempts_total}: {edit42.state}, replayed="
                      f"{result.headers.get('idempotent-replayed') if result else None}, "
                      f"result {result.body if result else None}")  # fmt: skip
                print(f"store after the replay: {stored_row(db)} (the newer value stays)")

                # 4. A new change decided against version 1 is refused, and recorded failed.
                change(ob, "edit-44", expected_version=1, minutes=45)
                edit44 = settle(ob, "edit-44")
                refusal = edit44.result
                print(f"edit-44: {edit44.state}, "
                      f"{refusal.status_code if refusal else None} "
                      f"{refusal.body if refusal else None}")  # fmt: skip

                checks = [
                    ("edit-42 succeeded on its retry", edit42.state is State.SUCCEEDED),
                    ("two request IDs for edit-42",
                     len({a.request_id for a in edit42.attempts}) == 2),
                    ("the retry got edit-42's own historical result",
                     result is not None
                     and result.body == {"id": 1, "interval_minutes": 30, "version": 2}
                     and result.headers.get("idempotent-replayed") == "true"),
                    ("the newer value stayed in place", stored_row(db) == (60, 3)),
                    ("edit-42 applied once", service.effect_count(key="edit-42") == 1),
                    ("edit-44 (stale version, new key) recorded failed",
                     edit44.state is State.FAILED
                     and refusal is not None and refusal.status_code == 412),
                    ("edit-44 changed nothing", service.effect_count(key="edit-44") == 0),
                ]  # fmt: skip
            finally:
                ob.close()
    for name, ok in checks:
        print(f"[{'ok' if ok else 'FAILED'}] {name}")
    return 0 if checks and all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
