"""Processes for the failed-WAL-fsync tests (``tests/faults/test_sqlite_fsync.py``).

``python -m tests.faults.fsync_app hold PATH``: a second process with the file open (as
a dispatcher has), having read from it; prints ``ready`` and waits to be killed.

``python -m tests.faults.fsync_app enqueue URL ARM ID...``: an application (run under
the shim) that enqueues a first operation normally, then creates the file ``ARM`` (the
shim's trigger: the next WAL fsync fails; or its *always* file) and enqueues each ``ID``
in its own transaction. For each it prints one JSON line: the exception's class (or
null), its message, and which operations ``find()`` sees afterwards. An ``ID`` of the
form ``many:A,B`` enqueues A and B in one ``enqueue_many``.
``OUTBOX_TEST_COMMIT_CHECK_SECONDS`` shortens how long a failed COMMIT is looked into.
Then it prints ``done`` and waits to be killed.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from dataclasses import asdict
from pathlib import Path

from outbox import Endpoint, Intent, Outbox
from outbox.store import commit


def hold(path: str) -> None:
    conn = sqlite3.connect(path)
    conn.execute("SELECT count(*) FROM outbox_operations").fetchall()
    print("ready", flush=True)
    time.sleep(3600)


def _intent(op_id: str) -> Intent:
    return Intent(endpoint="svc", method="POST", path="/charge", json={"amount": 100},
                  operation_id=op_id)  # fmt: skip


def enqueue(url: str, arm: str, op_ids: list[str]) -> None:
    seconds = os.environ.get("OUTBOX_TEST_COMMIT_CHECK_SECONDS")
    if seconds:
        commit.COMMIT_CHECK_SECONDS = float(seconds)
    outbox = Outbox(url, endpoints=[Endpoint(name="svc", base_url="http://127.0.0.1:9")],
                    auto_migrate=False)  # fmt: skip
    outbox.enqueue(endpoint="svc", method="POST", path="/warm", json={}, operation_id="warm")
    Path(arm).touch()
    for op_id in op_ids:
        ids = op_id.removeprefix("many:").split(",")
        raised: BaseException | None = None
        try:
            if op_id.startswith("many:"):
                outbox.enqueue_many([_intent(one) for one in ids])
            else:
                outbox.enqueue(**asdict(_intent(op_id)))
        except Exception as exc:  # reported to the test, which judges it
            raised = exc
        answer = {
            "operation_id": op_id,
            "raised": None if raised is None else type(raised).__name__,
            "message": None if raised is None else str(raised),
            "found": [one for one in ids if outbox.find(one) is not None],
        }
        print(json.dumps(answer), flush=True)
    print("done", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold(sys.argv[2])
    else:
        enqueue(sys.argv[2], sys.argv[3], sys.argv[4:])
