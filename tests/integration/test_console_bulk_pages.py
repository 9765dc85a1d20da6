"""The console's bulk action over 1,600 operations (issue 29; more than the 1,500 the
apply form could once carry): one preview of them all, then the apply in pages of
``BULK_PAGE`` with the progress on each page, one audit row per operation carrying the
previewed filters, as the CLI's do. A page posted twice, or by another session, acts on
nothing. Starlette's test client over a real SQLite file and a real PostgreSQL schema."""

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
BOB = "bob-" + "b" * 20
N = 1600


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


def _apply_fields(page: str) -> dict[str, list[str]]:
    form = page[page.index('<form method="post" action="/bulk" class="card">') :]
    fields: dict[str, list[str]] = {}
    for name, value in re.findall(r'name="([^"]+)" value="([^"]*)"', form[: form.index("</form>")]):
        fields.setdefault(name, []).append(value)
    return fields


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_a_bulk_action_over_1600_operations_runs_in_pages_with_progress(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = (
        f"sqlite:///{tmp_path / 'o.sqlite3'}"
        if dialect == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    _build(url)
    creds = Credentials.parse(f"alice:{TOKEN}\nbob:{BOB}\n", default_name="nobody", source="test")
    with Outbox(url) as ob:
        app = create_app(ob, creds)
        c = TestClient(app, base_url="http://127.0.0.1")
        c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        csrf = re.search(r'name="csrf" value="([^"]+)"', c.get("/queue").text)
        assert csrf
        form = {"csrf": csrf.group(1), "step": "preview", "view": "queue",
                "action": "resolve", "outcome": "failed", "note": "supplier closed",
                "tenant": "acme"}  # fmt: skip
        page = c.post("/bulk", data=form).text
        assert f"would change: {N}" in page and f"Apply to {N}" in page
        assert f'id="bulk-matched">{N}<' in page
        # Another operator's session on the same console cannot use this preview.
        bob = TestClient(app, base_url="http://127.0.0.1")
        bob.post("/login", data={"token": BOB}, follow_redirects=False)
        bob_csrf = re.search(r'name="csrf" value="([^"]+)"', bob.get("/queue").text)
        assert bob_csrf
        theirs = {**_apply_fields(page), "csrf": [bob_csrf.group(1)]}
        refused = bob.post("/bulk", data=theirs)
        assert refused.status_code == 400 and "that bulk preview is gone" in refused.text
        seen = []
        replayed = False
        for _ in range(N // BULK_PAGE + 1):
            fields = _apply_fields(page)
            page = c.post("/bulk", data=fields).text
            if not replayed:  # the same page posted twice (a double click, a reload)
                replayed = True
                again = c.post("/bulk", data=fields)
                assert again.status_code == 400 and "already applied" in again.text
            progress = re.search(r'id="bulk-progress">(\d+) of (\d+) done<', page)
            assert progress, page[:2000]
            seen.append((int(progress.group(1)), int(progress.group(2))))
            before = seen[-2][0] if len(seen) > 1 else 0
            assert f"changed: {seen[-1][0] - before}" in page
            if "Continue:" not in page:
                break
    pages = -(-N // BULK_PAGE)
    assert seen == [(min(BULK_PAGE * (i + 1), N), N) for i in range(pages)]
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


def test_a_large_preview_is_read_a_page_per_request_before_the_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many operations match, no request previews more than ``PREVIEW_PAGE`` of
    them (here 500 of 1,600): the page says how far the preview got, the apply waits for
    its end, and a preview page posted twice reads nothing twice."""
    import outbox.console.bulkviews

    monkeypatch.setattr(outbox.console.bulkviews, "PREVIEW_PAGE", 500)
    url = f"sqlite:///{tmp_path / 'o.sqlite3'}"
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
        progress = []
        while "Continue the preview" in page:
            progress.append(re.search(r'id="preview-progress">([^<]+)<', page).group(1))  # type: ignore[union-attr]
            fields = _apply_fields(page)
            if len(progress) == 1:
                early = c.post("/bulk", data={**fields, "step": ["apply"], "at": ["0"]})
                assert early.status_code == 400 and "not finished" in early.text
            page = c.post("/bulk", data=fields).text
            if len(progress) == 1:
                again = c.post("/bulk", data=fields)
                assert again.status_code == 400 and "already read" in again.text
        assert progress == [f"{n} of {N} previewed" for n in (500, 1000, 1500)]
        assert f"would change: {N}" in page and f"Apply to {N}</button>" in page
        assert f'id="bulk-matched">{N}<' in page
        assert "The first 500 of 1600 are listed" in page
        engine = create_engine(url)
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(audit)).scalar_one() == 0
        while "Apply to" in page or "Continue:" in page:
            page = c.post("/bulk", data=_apply_fields(page)).text
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(audit)).scalar_one() == N
        engine.dispose()
