"""``outbox audit``: the operator actions, read as a real process on a real SQLite file and
the real PostgreSQL server: filters, paging with the total, JSON, and never a new database.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from outbox import Endpoint, FakeClock, Outbox
from outbox.reconcile import Reconciler
from tests.acceptance.test_cli_operator import one_error_line, run
from tests.integration._reconcile_states import AUDIT_ENTRY_KEYS, AUDIT_PAGE_KEYS

HOUR_MS = 3_600_000


def _cancel(url: str, now_ms: int, operator: str, *operation_ids: str) -> None:
    endpoint = Endpoint(name="api", base_url="http://127.0.0.1:9")
    with Outbox(url, endpoints=[endpoint], clock=FakeClock(start_ms=now_ms)) as ob:
        for operation_id in operation_ids:
            ob.enqueue(endpoint="api", method="POST", path="/x", json={}, operation_id=operation_id)
            Reconciler(ob).cancel(operation_id, note=f"stop {operation_id}", operator=operator)


def test_audit_filters_pages_and_counts_every_match(db_url: str) -> None:
    now_ms = time.time_ns() // 1_000_000
    _cancel(db_url, now_ms - 3 * HOUR_MS, "alice", "old-1", "old-2")
    _cancel(db_url, now_ms, "bob", "new-1", "new-2", "new-3")
    db = ["--db", db_url]

    every = run(["audit", "--json", *db])
    assert every.returncode == 0, every.stderr
    data = json.loads(every.stdout)
    assert set(data) == AUDIT_PAGE_KEYS
    assert (data["total"], data["limit"], data["offset"]) == (5, 50, 0)
    assert all(set(e) == AUDIT_ENTRY_KEYS for e in data["entries"])
    # Newest first.
    assert [e["operation_id"] for e in data["entries"]] == [
        "new-3", "new-2", "new-1", "old-2", "old-1"
    ]  # fmt: skip
    assert {(e["action"], e["to_state"]) for e in data["entries"]} == {("cancel", "cancelled")}
    assert data["entries"][-1]["note"] == "stop old-1"

    def ids(*args: str) -> tuple[int, list[str]]:
        result = run(["audit", "--json", *args, *db])
        assert result.returncode == 0, result.stderr
        page = json.loads(result.stdout)
        return page["total"], [e["operation_id"] for e in page["entries"]]

    assert ids("--actor", "alice") == (2, ["old-2", "old-1"])
    assert ids("--actor", "nobody") == (0, [])
    assert ids("--older-than", "1h") == (2, ["old-2", "old-1"])
    assert ids("--newer-than", "1h") == (3, ["new-3", "new-2", "new-1"])
    assert ids("--operation", "new-2") == (1, ["new-2"])
    assert ids("--operation", "new-2", "--actor", "alice") == (0, [])
    # A page carries the total matching, not the page's length.
    assert ids("--limit", "2", "--offset", "1") == (5, ["new-2", "new-1"])

    table = run(["audit", "--limit", "2", *db])
    assert table.returncode == 0, table.stderr
    assert "(2 shown of 5 matching)" in table.stdout
    assert "more: outbox audit --limit 2 --offset 2" in table.stdout
    filtered = run(["audit", "--actor", "alice", *db]).stdout
    assert "(2 shown of 2 matching)" in filtered and "more:" not in filtered

    # Bad input: one line, exit 2.
    for bad in (["--limit", "0"], ["--offset", "-1"], ["--older-than", "yesterday"]):
        result = run(["audit", *bad, *db])
        assert result.returncode == 2, (bad, result.stderr)
        one_error_line(result)


def test_audit_never_creates_a_database(tmp_path: Path) -> None:
    missing = tmp_path / "typo" / "outbox.sqlite3"
    url = f"sqlite:///{missing}"
    result = run(["audit", "--db", url])
    assert result.returncode == 3
    assert "does not exist" in one_error_line(result)
    assert result.stdout == ""
    assert not missing.parent.exists()


def test_audit_on_an_empty_outbox_is_an_empty_page(db_url: str) -> None:
    with Outbox(db_url, endpoints=[Endpoint(name="api", base_url="http://127.0.0.1:9")]):
        pass
    data = json.loads(run(["audit", "--json", "--db", db_url]).stdout)
    assert data == {"total": 0, "limit": 50, "offset": 0, "entries": []}
