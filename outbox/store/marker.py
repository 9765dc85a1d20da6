"""The ID of enqueue's own transaction, carried on its INSERT's RETURNING.

After a failed COMMIT, ``outbox.store.commit`` asks PostgreSQL what became of the
transaction (``pg_xact_status``), so it needs the transaction's ID from before the
COMMIT. Reading it with a statement of its own cost a round trip on every enqueue; the
INSERT returns it instead (``pg_current_xact_id()``, the ID the INSERT assigns anyway).

``write_and_commit`` opens a slot on its own connection (``conn.info``) before the work
and reads it after; the INSERT fills it when the slot is open. An enqueue on the
caller's connection has no slot: nothing is recorded there.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

#: Key in ``Connection.info`` (the pooled connection's own dict).
_SLOT = "outbox_transaction_marker"
#: The label of the RETURNING column a store adds to name the transaction
#: (``Store._insert_marks``; PostgreSQL's ``pg_current_xact_id()``).
COLUMN = "transaction_marker"


def open_slot(conn: Connection) -> dict[Any, Any]:
    """Open the slot on ``conn``; returns the dict that holds it, for :func:`close_slot`
    (kept, because an invalidated connection no longer lends its ``info``)."""
    info = conn.info
    info[_SLOT] = None
    return info


def close_slot(info: dict[Any, Any]) -> str | None:
    """The marker an INSERT recorded since :func:`open_slot`, if any; closes the slot."""
    value = info.pop(_SLOT, None)
    return None if value is None else str(value)


def note_marker(conn: Connection, row: Any) -> None:
    """Record ``row``'s transaction marker, if the slot is open and the row has one."""
    if row is None or _SLOT not in conn.info or conn.info[_SLOT] is not None:
        return
    value = row._mapping.get(COLUMN)
    if value is not None:
        conn.info[_SLOT] = value
