"""An application process that enqueues through an engine of its own, made with plain
``sqlalchemy.create_engine`` on the outbox's SQLite file, inside its own transactions.

It reads one command per line on stdin and answers one JSON line on stdout:
``rollback ID`` (enqueue in a transaction that then rolls back), ``commit ID`` (enqueue
in a transaction that commits), ``count`` (what the application itself sees), ``dispose``
(``engine.dispose()``), ``quit``. Run: ``python -m tests.support.plain_engine_app URL``.
"""

from __future__ import annotations

import json
import sys

import sqlalchemy as sa

from outbox import Endpoint, Outbox


class _RolledBack(Exception):
    pass


def main(url: str) -> None:
    engine = sa.create_engine(url)
    # The application's own tables first: its engine holds a pooled connection on the
    # file before the Outbox is made, as a real application's does.
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS app_orders (id INTEGER PRIMARY KEY)")
    outbox = Outbox(
        engine, endpoints=[Endpoint(name="svc", base_url="http://127.0.0.1:9")], auto_migrate=False
    )
    for line in sys.stdin:
        verb, _, arg = line.strip().partition(" ")
        answer: dict[str, object] = {"ok": True}
        if verb == "rollback":
            try:
                with engine.begin() as conn:
                    _enqueue(outbox, conn, arg)
                    raise _RolledBack
            except _RolledBack:
                pass
        elif verb == "commit":
            with engine.begin() as conn:
                _enqueue(outbox, conn, arg)
        elif verb == "count":
            with engine.connect() as conn:
                answer["count"] = conn.exec_driver_sql(
                    "SELECT count(*) FROM outbox_operations"
                ).scalar()
            answer["get"] = [op for op in arg.split() if outbox.find(op) is not None]
        elif verb == "dispose":
            engine.dispose()
        elif verb == "quit":
            break
        print(json.dumps(answer), flush=True)
    outbox.close()
    engine.dispose()


def _enqueue(outbox: Outbox, conn: sa.Connection, op_id: str) -> None:
    outbox.enqueue(
        endpoint="svc", method="POST", path="/orders", json={"id": op_id},
        operation_id=op_id, connection=conn,
    )  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
