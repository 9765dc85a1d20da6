"""``Store.purge`` walks each terminal state in keyset batches (issue 27, section 4):
every old terminal row goes, however many share an ``updated_at``; live rows and rows
changed after the cutoff stay."""

from __future__ import annotations

from sqlalchemy import text

from outbox import Outbox

_COLS = (
    "tenant, operation_id, endpoint, method, path, headers, args_sha256, state, "
    "next_attempt_at, created_at, updated_at, finished_at"
)


def _row(conn: object, oid: str, state: str, updated: int, finished: int | None) -> None:
    conn.execute(  # type: ignore[attr-defined]
        text(
            f"INSERT INTO outbox_operations ({_COLS}) VALUES ('', :oid, 'rx', 'POST', '/p', "
            "'{}', 'x', :state, NULL, 1, :updated, :finished)"
        ),
        {"oid": oid, "state": state, "updated": updated, "finished": finished},
    )


def test_purge_takes_every_old_terminal_row_in_batches(db_url: str) -> None:
    ob = Outbox(db_url)
    try:
        with ob.engine.begin() as conn:
            # Seven succeeded rows, four of them sharing one updated_at (ties across a
            # batch boundary), two failed, one cancelled: all finished before 1000.
            for i, updated in enumerate((100, 200, 200, 200, 200, 300, 400)):
                _row(conn, f"ok-{i}", "succeeded", updated, updated)
            for i in range(2):
                _row(conn, f"bad-{i}", "failed", 500, 500)
            _row(conn, "cancel-0", "cancelled", 600, 600)
            # Kept: finished before the cutoff but changed after it; newer; live.
            _row(conn, "touched", "succeeded", 5000, 500)
            _row(conn, "new", "succeeded", 2000, 2000)
            _row(conn, "live", "unresolved", 100, None)
        batches: list[int] = []
        removed = ob.store.purge(finished_before_ms=1000, batch_size=2, on_batch=batches.append)
        assert removed == {"succeeded": 7, "failed": 2, "cancelled": 1}
        assert batches == [2, 2, 2, 1, 2, 1]
        with ob.engine.connect() as conn:
            left = sorted(
                r[0] for r in conn.execute(text("SELECT operation_id FROM outbox_operations"))
            )
        assert left == ["live", "new", "touched"]
    finally:
        ob.close()
