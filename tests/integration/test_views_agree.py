"""One database, four views, one set of numbers (issue 29).

The database holds known rows (written here as SQL, at times relative to now): pending
operations (due, not yet due, one unsendable), unresolved ones of two reasons, some whose
key the receiver forgets within the hour, some whose key it has already forgotten, some
far from expiry, and settled history. No application is named (no ``--app``): every
figure comes from the policy snapshot stored with each row. Then:

* ``outbox status --json`` runs as a subprocess;
* ``outbox status --check`` runs as a subprocess (its PROBLEM lines carry the figures);
* the console's overview is fetched through Starlette's test client;
* ``/metrics`` is rendered by prometheus_client from :class:`OutboxMetrics`.

Each is parsed, and all four must say what the rows say, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert, select, update
from starlette.testclient import TestClient

from outbox import Outbox
from outbox.console import Credentials, create_app
from outbox.store.migrate import upgrade
from outbox.store.tables import attempts, operations

REPO = Path(__file__).resolve().parents[2]
TOKEN = "alice-" + "a" * 20
HOUR = 3_600_000
DAY = 24 * HOUR

#: What the rows below make every view say.
EXPECTED = {
    "pending": 5,
    "in_flight": 0,
    "unresolved": 6,
    "succeeded": 7,
    "failed": 2,
    "cancelled": 1,
    "near": 3,  # two unresolved + one pending, key expires within the hour
    "expired": 2,  # two unresolved whose key is already forgotten: past, not near
    "due": 4,
    "unsendable": 1,
    "by_reason": {"retries_exhausted": 4, "outcome_unknown": 2},
    # Attempts started in the last hour (the one 90 minutes ago is not), and the chart:
    # minute 0 is 60 minutes ago; each attempt starts mid-minute (4.5 minutes ago is in
    # minute 55), so the seconds the views take to run do not move it.
    "attempts": 6,
    "chart": {(55, "success"): 1, (55, "retry"): 1, (40, "failed"): 1, (40, "success"): 1,
              (20, "other"): 1, (1, "other"): 1},
}


def _row(oid: str, state: str, now: int, **kw: Any) -> dict[str, Any]:
    row = {
        "tenant": "",
        "operation_id": oid,
        "endpoint": "payments",
        "method": "POST",
        "path": "/pay",
        "headers": "{}",
        "args_sha256": "x",
        "state": state,
        "created_at": now - 10 * HOUR,
        "updated_at": now - 5 * HOUR,
        "policy_key_retention_ms": DAY,
        "next_attempt_at": None,
        "first_attempt_at": None,
        "finished_at": None,
        "reason": None,
        "last_error": None,
    }
    row.update(kw)
    return row


def build(url: str) -> None:
    from outbox.store.engine import create_engine

    engine = create_engine(url)
    upgrade(engine)
    now = int(time.time() * 1000)
    soon = now - DAY + 30 * 60_000  # key expires in 30 minutes
    gone = now - DAY - 2 * HOUR  # key expired two hours ago
    far = now - 2 * HOUR  # key expires in 22 hours
    rows = [
        _row("p-due-1", "pending", now, next_attempt_at=now - 60_000),
        _row("p-due-2", "pending", now, next_attempt_at=now - 1000, first_attempt_at=far),
        _row("p-due-3", "pending", now, next_attempt_at=now - 1000, first_attempt_at=soon),
        _row("p-dark", "pending", now, next_attempt_at=now - 1000, last_error="no endpoint"),
        _row("p-later", "pending", now, next_attempt_at=now + HOUR),
        _row("u-soon-1", "unresolved", now, reason="retries_exhausted", first_attempt_at=soon),
        _row("u-soon-2", "unresolved", now, reason="outcome_unknown", first_attempt_at=soon),
        _row("u-gone-1", "unresolved", now, reason="retries_exhausted", first_attempt_at=gone),
        _row("u-gone-2", "unresolved", now, reason="outcome_unknown", first_attempt_at=gone),
        _row("u-far", "unresolved", now, reason="retries_exhausted", first_attempt_at=far),
        _row("u-none", "unresolved", now, reason="retries_exhausted"),
    ]
    for i in range(7):
        rows.append(_row(f"s-{i}", "succeeded", now, first_attempt_at=gone, finished_at=now))
    for i in range(2):
        rows.append(_row(f"f-{i}", "failed", now, first_attempt_at=soon, finished_at=now))
    rows.append(_row("c-0", "cancelled", now, first_attempt_at=soon, finished_at=now))
    with engine.begin() as conn:
        conn.execute(insert(operations), rows)
        pk = conn.execute(select(operations.c.id).where(operations.c.operation_id == "p-due-2"))
        pk = pk.scalar_one()
        # Attempts in the last hour, minutes apart, of every chart outcome; one older.
        spec = [(5, "success"), (5, "retry"), (20, "failed"), (20, "success"), (40, None),
                (59, "in_progress"), (90, "success")]  # fmt: skip
        conn.execute(insert(attempts), [
            {"operation_pk": pk, "number": i + 1, "request_id": f"r-{i}", "dispatcher_id": "d",
             "lease_token": "t", "started_at": now - ago * 60_000 + 30_000,
             "lease_until": now, "finished_at": None if verdict is None else now,
             "delivery": None if verdict is None else "sent", "verdict": verdict}
            for i, (ago, verdict) in enumerate(spec)
        ])  # fmt: skip
    engine.dispose()


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUTBOX_DB": url}
    return subprocess.run(
        [sys.executable, "-m", "outbox", "status", *args],
        check=False, env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def cli_json(url: str) -> dict[str, Any]:
    import json

    done = _cli(url, "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    f = d["figures"]
    return {
        **{s: d["counts"][s] for s in ("pending", "in_flight", "unresolved")},
        **{s: d["counts"][s] for s in ("succeeded", "failed", "cancelled")},
        "near": f["keys_near_expiry"],
        "expired": f["keys_expired"],
        "due": f["due"],
        "unsendable": f["unsendable"],
        "by_reason": {k: v for k, v in f["unresolved_by_reason"].items() if v},
        "attempts": f["attempts_last_hour"],
        "chart": _nonzero(f["attempts_per_minute"]),
    }


def _nonzero(per_minute: list[dict[str, int]]) -> dict[tuple[int, str], int]:
    return {(i, k): n for i, m in enumerate(per_minute) for k, n in m.items() if n}


def cli_check(url: str) -> dict[str, Any]:
    done = _cli(url, "--check", "--max-unresolved", "0", "--max-near-expiry", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    text = done.stdout
    found = {
        "unresolved": r"PROBLEM: (\d+) unresolved operations",
        "near": r"PROBLEM: (\d+) live operations within 1h of key expiry",
        "expired": r"keys already expired: (\d+)",
        "unsendable": r"PROBLEM: (\d+) pending operations cannot be sent",
    }
    out = {}
    for name, pattern in found.items():
        match = re.search(pattern, text)
        assert match, f"{pattern!r} not in:\n{text}"
        out[name] = int(match.group(1))
    return out


def console(url: str) -> dict[str, Any]:
    creds = Credentials.parse(f"alice:{TOKEN}\n", default_name="nobody", source="test")
    with Outbox(url) as ob:
        c = TestClient(create_app(ob, creds), base_url="http://127.0.0.1")
        r = c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        assert r.status_code == 303
        page = c.get("/").text
    out: dict[str, Any] = {}
    for state in EXPECTED:
        match = re.search(rf'<span class="n">(\d+)</span><span class="label">{state}</span>', page)
        if match:
            out[state] = int(match.group(1))
    for name, key in (("near", "keys_near_expiry"), ("expired", "keys_expired")):
        match = re.search(rf'data-figure="{key}">(\d+)<', page)
        assert match, key
        out[name] = int(match.group(1))
    row = re.search(
        r"<tr><td>payments</td><td class=\"num\">(\d+)</td>.*?<td class=\"num\">(\d+)</td>"
        r"<td class=\"num\">(\d+)</td><td class=\"num\">(\d+)</td></tr>",
        page,
        re.S,
    )
    assert row, page
    out["due"], out["unsendable"] = int(row.group(1)), int(row.group(4))
    chart = re.search(r'data-chart="attempts-per-minute" data-total="(\d+)"', page)
    assert chart, "no attempts chart on the overview"
    out["attempts"] = int(chart.group(1))
    out["chart"] = {
        (int(m), o): int(n)
        for m, o, n in re.findall(
            r'data-minute="(\d+)" data-outcome="(\w+)" data-n="(\d+)"', page
        )
    }
    out["by_reason"] = {
        reason: int(n)
        for reason, n in re.findall(
            r'<a href="/queue\?reason=(\w+)">\w+</a></td><td class="num">(\d+)</td>', page
        )
        if int(n)
    }
    return out


def metrics(url: str) -> dict[str, Any]:
    with Outbox(url) as ob:
        registry = CollectorRegistry()
        ob.metrics(registry=registry)
        text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    ep = (("endpoint", "payments"),)
    by_reason = {
        dict(labels)["reason"]: int(v)
        for (name, labels), v in samples.items()
        if name == "outbox_unresolved_operations" and v
    }
    return {
        "in_flight": int(samples[("outbox_in_flight_operations", ep)]),
        "unresolved": sum(by_reason.values()),
        "near": int(samples[("outbox_operations_near_key_expiry", ep)]),
        "expired": int(samples[("outbox_operations_key_expired", ep)]),
        "due": int(samples[("outbox_due_operations", ep)]),
        "unsendable": int(samples[("outbox_unsendable_operations", ep)]),
        "by_reason": by_reason,
    }


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_the_four_views_give_the_same_numbers(dialect: str, request: pytest.FixtureRequest,
                                              tmp_path: Path) -> None:  # fmt: skip
    if dialect == "sqlite":
        url = f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    else:
        url = request.getfixturevalue("pg_url")
    build(url)
    views = {
        "status --json": cli_json(url),
        "status --check": cli_check(url),
        "console": console(url),
        "/metrics": metrics(url),
    }
    # The closing note's side-by-side table.
    print()
    for name, figures in views.items():
        print(f"{name:15} {figures}")
    for name, figures in views.items():
        for key, value in figures.items():
            assert value == EXPECTED[key], f"{name}: {key} = {value}, rows say {EXPECTED[key]}"
    assert set(views["status --json"]) == set(EXPECTED)
    assert {"near", "expired", "due", "unsendable", "by_reason"} <= set(views["/metrics"])


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_oldest_first_is_one_order_in_the_cli_and_the_console(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """ "Oldest first" is by entry into the reconciliation queue (the last change), then
    row ID: enqueue order runs the other way, and two rows share an entry time."""
    import json

    from outbox.store.engine import create_engine

    if dialect == "sqlite":
        url = f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    else:
        url = request.getfixturevalue("pg_url")
    engine = create_engine(url)
    upgrade(engine)
    now = int(time.time() * 1000)
    # Enqueued a, b, c, d, e (created_at ascending); unresolved in the order e, (c, d), b, a.
    entered = {"e": 5, "c": 4, "d": 4, "b": 3, "a": 1}
    rows = [
        _row(f"q-{name}", "unresolved", now, reason="retries_exhausted",
             created_at=now - 10 * HOUR + i, updated_at=now - entered[name] * 60_000)
        for i, name in enumerate("abcde")
    ]  # fmt: skip
    with engine.begin() as conn:
        conn.execute(insert(operations), rows)
    engine.dispose()
    expected = ["q-e", "q-c", "q-d", "q-b", "q-a"]

    done = subprocess.run(
        [sys.executable, "-m", "outbox", "reconcile", "list", "--json"],
        env={**os.environ, "OUTBOX_DB": url}, cwd=REPO, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    cli = [op["operation_id"] for op in json.loads(done.stdout)["operations"]]

    creds = Credentials.parse(f"alice:{TOKEN}\n", default_name="nobody", source="test")
    with Outbox(url) as ob:
        c = TestClient(create_app(ob, creds), base_url="http://127.0.0.1")
        c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        page = c.get("/queue").text
        newest = c.get("/queue?sort=newest").text
    console_ids = re.findall(r'<td class="mono"><a href="[^"]*">(q-\w)</a>', page)
    console_newest = re.findall(r'<td class="mono"><a href="[^"]*">(q-\w)</a>', newest)
    assert cli == expected
    assert console_ids == expected
    assert console_newest == expected[::-1]


def test_an_operations_timeline_is_drawn_from_its_policy_snapshot(tmp_path: Path) -> None:
    """The operation page's SVG time line: one dot per attempt at its start, and the key
    expiry at first attempt + the snapshot's retention (no application given)."""
    from outbox.store.engine import create_engine

    url = f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    build(url)
    engine = create_engine(url)
    with engine.begin() as conn:  # the whole policy snapshot, as an enqueue stores it
        conn.execute(
            update(operations).where(operations.c.operation_id == "p-due-2").values(
                policy_window_ms=HOUR, policy_margin_ms=5 * 60_000, policy_max_attempts=8,
                policy_in_progress_budget=10, window_started_at=operations.c.first_attempt_at,
            )
        )  # fmt: skip
    with engine.connect() as conn:
        first, window = conn.execute(
            select(operations.c.first_attempt_at, operations.c.policy_key_retention_ms)
            .where(operations.c.operation_id == "p-due-2")
        ).one()  # fmt: skip
        started = conn.execute(select(attempts.c.started_at).order_by(attempts.c.number))
        started = [int(s) for s in started.scalars()]
    engine.dispose()
    creds = Credentials.parse(f"alice:{TOKEN}\n", default_name="nobody", source="test")
    with Outbox(url) as ob:
        c = TestClient(create_app(ob, creds), base_url="http://127.0.0.1")
        c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        page = c.get("/operation?tenant=&id=p-due-2").text
    svg = re.search(r'<svg[^>]*data-chart="timeline"[^>]*>', page)
    assert svg, "no timeline on the operation page"
    assert f'data-key-expires="{first + window}"' in svg.group(0)
    assert f'data-attempts="{len(started)}"' in svg.group(0)
    assert f'data-window-closes="{first + HOUR}"' in svg.group(0)
    assert f'data-last-send="{first + window - 5 * 60_000}"' in svg.group(0)
    assert [int(s) for s in re.findall(r'data-started="(\d+)"', page)] == started
