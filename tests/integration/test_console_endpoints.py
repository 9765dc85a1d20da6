"""The console's endpoints page (issue 23: the breaker "in an operator's terms"): each
endpoint's circuit or pause, since when, why, probes and next probe, the same figures as
``outbox endpoint list``; and pause/resume from the console, audited by the store call
the CLI makes. Starlette's test client over a real SQLite file and PostgreSQL schema;
every effect is read back from ``outbox_endpoints`` and ``outbox_audit``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from starlette.testclient import TestClient

from outbox import Endpoint, FakeClock, Outbox
from outbox.console import Credentials, create_app
from outbox.store.engine import create_engine
from outbox.store.tables import audit, endpoint_states

ALICE = "alice-" + "a" * 20
T0 = 1_800_000_000_000
OUTBOX = Path(sys.executable).with_name("outbox")


def _client(ob: Outbox, **kw: Any) -> TestClient:
    creds = Credentials.parse(f"alice:{ALICE}\n", default_name="nobody", source="test")
    c = TestClient(create_app(ob, creds, **kw), base_url="http://127.0.0.1")
    assert c.post("/login", data={"token": ALICE}, follow_redirects=False).status_code == 303
    return c


def _csrf(page: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match
    return match.group(1)


def _tables(url: str) -> tuple[list[Any], list[Any]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            states = conn.execute(
                select(endpoint_states.c.name, endpoint_states.c.paused,
                       endpoint_states.c.circuit, endpoint_states.c.blocked,
                       endpoint_states.c.reason).order_by(endpoint_states.c.name)
            ).all()  # fmt: skip
            rows = conn.execute(
                select(audit.c.tenant, audit.c.operation_id, audit.c.actor, audit.c.action,
                       audit.c.from_state, audit.c.to_state, audit.c.note).order_by(audit.c.id)
            ).all()  # fmt: skip
    finally:
        engine.dispose()
    return [tuple(r) for r in states], [tuple(r) for r in rows]


def _world(url: str) -> Outbox:
    clock = FakeClock(T0)
    ob = Outbox(url, clock=clock)
    for name in ("payments", "ledger", "mail"):
        ob.register(Endpoint(name=name, base_url="http://127.0.0.1:9"))
    # The fleet saw "ledger" fail 5 times in a row: its circuit is open, probed at T0+30 s.
    assert ob.store.count_failures("ledger", failures=5, threshold=5, reason="connection refused",
                                   now_ms=T0 - 60_000, next_probe_at=T0 + 30_000)  # fmt: skip
    return ob


def _row(page: str, name: str) -> str:
    start = page.index(f'data-endpoint="{name}"')
    return page[start : page.index("</tr>", start)]


def test_endpoints_page_shows_each_circuit_as_the_cli_prints_it(db_url: str) -> None:
    with _world(db_url) as ob:
        c = _client(ob)
        page = c.get("/endpoints").text
        cli = json.loads(
            subprocess.run(
                [str(OUTBOX), "--db", db_url, "endpoint", "list", "--json"],
                check=True, capture_output=True, text=True,
            ).stdout
        )  # fmt: skip
        overview = c.get("/").text
    assert [r["endpoint"] for r in cli] == ["ledger"]
    ledger = _row(page, "ledger")
    assert 'data-state="open"' in ledger and "connection refused" in ledger
    assert cli[0]["circuit"] == "open" and cli[0]["probes"] == 0
    assert 'data-probes="0"' in ledger
    assert "for 1m 0s" in ledger  # since T0 - 60 s
    assert "in 30s" in ledger  # next probe at T0 + 30 s
    assert "2027-01-15 08:00:30.000Z" in ledger  # the next probe's time, as `when` prints it
    for name in ("mail", "payments"):
        assert 'data-state="closed"' in _row(page, name)
    # The overview names every endpoint's fleet state too (Figures.circuits).
    assert 'data-endpoint="ledger" data-state="open"' in overview
    assert 'data-endpoint="payments" data-state="closed"' in overview


def test_pause_and_resume_from_the_console_are_audited_under_the_signed_in_name(
    db_url: str,
) -> None:
    with _world(db_url) as ob:
        c = _client(ob)
        csrf = _csrf(c.get("/endpoints").text)
        r = c.post("/endpoints/pause", data={"csrf": csrf, "name": "payments",
                                             "note": "supplier maintenance 02:00-03:00"},
                   follow_redirects=False)  # fmt: skip
        assert r.status_code == 303 and r.headers["location"].startswith("/endpoints?done=paused")
        page = c.get("/endpoints?done=paused").text
        assert "Paused: nothing of it is claimed" in page
        assert 'data-state="paused"' in _row(page, "payments")
        assert 'action="/endpoints/resume"' in _row(page, "payments")
        states, rows = _tables(db_url)
        assert (
            "payments",
            1,
            "closed",
            1,
            "paused by alice: supplier maintenance 02:00-03:00",
        ) in states
        assert rows == [("@endpoint", "payments", "alice", "pause", "closed", "paused",
                         "supplier maintenance 02:00-03:00")]  # fmt: skip
        # The CLI sees the pause the console made.
        cli = json.loads(
            subprocess.run([str(OUTBOX), "--db", db_url, "endpoint", "list", "--json"],
                           check=True, capture_output=True, text=True).stdout
        )  # fmt: skip
        assert {r["endpoint"]: r["paused"] for r in cli} == {"ledger": False, "payments": True}
        # Resuming the open "ledger" keeps its circuit open, to be probed at once.
        c.post("/endpoints/resume", data={"csrf": csrf, "name": "payments", "note": "done"})
        c.post("/endpoints/pause", data={"csrf": csrf, "name": "ledger", "note": "deploy"})
        c.post("/endpoints/resume", data={"csrf": csrf, "name": "ledger", "note": "deployed"})
        states, rows = _tables(db_url)
        audit_page = c.get("/audit").text
    assert [s[:4] for s in states] == [("ledger", 0, "open", 1), ("payments", 0, "closed", 0)]
    assert [r[3:6] for r in rows] == [
        ("pause", "closed", "paused"),
        ("resume", "paused", "closed"),
        ("pause", "open", "paused"),
        ("resume", "paused", "open"),
    ]
    assert 'href="/endpoints#endpoint-ledger"' in audit_page


def test_bad_endpoint_posts_are_refused_and_write_nothing(db_url: str) -> None:
    with _world(db_url) as ob:
        c = _client(ob)
        csrf = _csrf(c.get("/endpoints").text)
        before = _tables(db_url)
        cases = [
            ("/endpoints/pause", {"csrf": csrf, "name": "payments", "note": "  "}, 400,
             "a note is required"),
            ("/endpoints/pause", {"csrf": csrf, "name": "nowhere", "note": "x"}, 400,
             "no endpoint &#39;nowhere&#39; is known"),
            ("/endpoints/explode", {"csrf": csrf, "name": "payments", "note": "x"}, 400,
             "unknown endpoint action"),
            ("/endpoints/pause", {"name": "payments", "note": "x"}, 403, "security token"),
            ("/endpoints/pause", {"csrf": "forged", "name": "payments", "note": "x"}, 403,
             "security token"),
        ]  # fmt: skip
        for path, data, status, words in cases:
            r = c.post(path, data=data)
            assert r.status_code == status, (path, data, r.text[:500])
            assert words in r.text, (path, data)
        # Another site's form, with a valid token: refused by the origin check.
        r = c.post("/endpoints/pause", data={"csrf": csrf, "name": "payments", "note": "x"},
                   headers={"origin": "http://evil.example"})  # fmt: skip
        assert r.status_code == 403
        # No session: the sign-in page, nothing written.
        anon = TestClient(create_app(ob, Credentials.parse(f"alice:{ALICE}\n",
                          default_name="x", source="t")), base_url="http://127.0.0.1")  # fmt: skip
        assert (
            anon.post("/endpoints/pause", data={"name": "payments", "note": "x"}).status_code == 401
        )
        assert _tables(db_url) == before


def test_read_only_console_shows_the_fleet_but_no_switch(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'o.sqlite3'}"
    with _world(url) as ob:
        c = _client(ob, read_only=True)
        page = c.get("/endpoints").text
        assert 'data-state="open"' in _row(page, "ledger")
        assert 'action="/endpoints/' not in page
        r = c.post("/endpoints/pause", data={"csrf": _csrf(page), "name": "payments", "note": "x"})
        assert r.status_code == 403
    assert _tables(url)[1] == []


@pytest.mark.parametrize("name", ["payments"])
def test_the_endpoints_page_needs_a_session(tmp_path: Path, name: str) -> None:
    with _world(f"sqlite:///{tmp_path / 'o.sqlite3'}") as ob:
        creds = Credentials.parse(f"alice:{ALICE}\n", default_name="x", source="t")
        anon = TestClient(create_app(ob, creds), base_url="http://127.0.0.1")
        r = anon.get("/endpoints")
    assert r.status_code == 401 and name not in r.text
