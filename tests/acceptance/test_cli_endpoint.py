"""``outbox endpoint pause|resume`` and the circuit in ``outbox status``, as real
processes on a real SQLite file and the real PostgreSQL server."""

from __future__ import annotations

import json
import time

from sqlalchemy import func, select

from outbox import Endpoint, FakeClock, Outbox
from outbox.store.tables import endpoint_states
from tests.acceptance.test_cli_operator import run


def _migrated(url: str) -> None:
    with Outbox(url, endpoints=[Endpoint(name="api", base_url="http://127.0.0.1:9")]):
        pass


def test_pause_and_resume_are_audited_and_shown_by_status(db_url: str) -> None:
    _migrated(db_url)
    # Without --app the database must name the endpoint: here, an operation of it.
    with Outbox(db_url, endpoints=[Endpoint(name="api", base_url="http://127.0.0.1:9")]) as ob:
        ob.enqueue(endpoint="api", method="POST", path="/orders", json={"n": 1})
    db = ["--db", db_url]
    paused = run(["endpoint", "pause", "api", "--note", "receiver deploy", "--operator",
                  "alice", "--json", *db])  # fmt: skip
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["paused"] is True
    status = run(["status", "--json", *db])
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    [row] = data["endpoint_states"]
    assert data["figures"]["circuits"] == {"api": "paused"}  # the figure every view renders
    assert (row["endpoint"], row["paused"], row["circuit"]) == ("api", True, "closed")
    assert "alice" in row["reason"]
    resumed = run(["endpoint", "resume", "api", "--note", "deploy done", "--operator", "bob", *db])
    assert resumed.returncode == 0, resumed.stderr
    trail = run(["audit", "--json", "--operation", "api", *db])
    entries = json.loads(trail.stdout)["entries"]
    assert [(e["action"], e["actor"], e["note"]) for e in entries] == [
        ("resume", "bob", "deploy done"), ("pause", "alice", "receiver deploy")
    ]  # fmt: skip


def test_a_bad_endpoint_name_is_refused_and_writes_nothing(db_url: str) -> None:
    _migrated(db_url)
    bad = run(["endpoint", "pause", "no such/name", "--note", "x", "--db", db_url])
    assert bad.returncode == 2
    assert "no endpoint 'no such/name' is known to this outbox" in bad.stderr
    with Outbox(db_url) as ob, ob.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(endpoint_states)).scalar() == 0


def test_status_check_fails_on_an_open_circuit(db_url: str) -> None:
    _migrated(db_url)
    now = time.time_ns() // 1_000_000
    with Outbox(db_url, clock=FakeClock(start_ms=now)) as ob:
        ob.store.count_failures("api", failures=5, threshold=5, reason="ConnectError",
                                now_ms=now, next_probe_at=now + 1000)  # fmt: skip
    check = run(["status", "--check", "--no-dispatcher-check", "--db", db_url])
    assert check.returncode == 1
    assert "endpoint api: circuit open" in check.stdout
