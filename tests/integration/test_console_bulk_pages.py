"""The console's bulk action over 1,000 operations (issue 29): one preview of them all,
then the apply in pages of ``BULK_PAGE`` with the progress on each page, one audit row
per operation carrying the previewed filters, as the CLI's do. Starlette's test client
over a real SQLite file and a real PostgreSQL schema."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from sqlalchemy import func, insert, select
from starlette.testclient import TestClient

from outbox import Outbox
from outbox.console import Credentials, create_app
from outbox.console.views import BULK_PAGE
from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from outbox.store.tables import audit, operations

TOKEN = "alice-" + "a" * 20
N = 1000


def _build(url: str) -> None:
    engine = create_engine(url)
    upgrade(engine)
    now = int(time.time() * 1000)
    rows = [
        {"tenant": "acme", "operation_id": f"op-{i:04d}", "endpoint": "payments",
         "method": "POST", "path": "/pay", "headers": "{}", "args_sha256": "x",
         "state": "unresolved", "reason": "retries_exhausted", "created_at": now - 10_000,
         "updated_at": now - 10_000 + i}
        for i in range(N)
    ] + [  # another tenant's: outside the filter, left alone
        {"tenant": "globex", "operation_id": "op-other", "endpoint": "payments",
         "method": "POST", "path": "/pay", "headers": "{}", "args_sha256": "x",
         "state": "unresolved", "reason": "retries_exhausted", "created_at": now,
         "updated_at": now}
    ]  # fmt: skip
    with engine.begin() as conn:
        conn.execute(insert(operations), rows)
    engine.dispose()


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_a_bulk_action_over_1000_operations_runs_in_pages_with_progress(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = (
        f"sqlite:///{tmp_path / 'o.sqlite3'}"
        if dialect == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    _build(url)
    creds = Credentials.parse(f"alice:{TOKEN}\n", default_name="nobody", source="test")
    with Outbox(url) as ob:
        c = TestClient(create_app(ob, creds), base_url="http://127.0.0.1")
        c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        csrf = re.search(r'name="csrf" value="([^"]+)"', c.get("/queue").text)
        assert csrf
        form = {"csrf": csrf.group(1), "step": "preview", "view": "queue",
                "action": "resolve", "outcome": "failed", "note": "supplier closed",
                "tenant": "acme"}  # fmt: skip
        page = c.post("/bulk", data=form).text
        assert "would change: 1000" in page and "Apply to 1000" in page
        seen = []
        for _ in range(N // BULK_PAGE + 1):
            fields: dict[str, list[str]] = {}
            action = page[page.index('<form method="post" action="/bulk" class="card">'):]
            for name, value in re.findall(r'name="([^"]+)" value="([^"]*)"', action):
                fields.setdefault(name, []).append(value)
            page = c.post("/bulk", data=fields).text
            progress = re.search(r'id="bulk-progress">(\d+) of (\d+) done<', page)
            assert progress, page[:2000]
            seen.append((int(progress.group(1)), int(progress.group(2))))
            assert f"changed: {BULK_PAGE}" in page
            if "Continue:" not in page:
                break
    assert seen == [(BULK_PAGE * (i + 1), N) for i in range(N // BULK_PAGE)]
    engine = create_engine(url)
    with engine.connect() as conn:
        states = dict(
            conn.execute(
                select(operations.c.tenant, func.count())
                .where(operations.c.state == "failed")
                .group_by(operations.c.tenant)
            ).all()
        )
        rows = conn.execute(select(audit.c.operation_id, audit.c.details)).all()
    engine.dispose()
    assert states == {"acme": N}
    assert len(rows) == N and len({r.operation_id for r in rows}) == N
    for r in rows:
        details = json.loads(r.details)
        assert details["bulk"] == {"tenant": "acme", "view": "queue"}
        assert details["via"] == "console"
