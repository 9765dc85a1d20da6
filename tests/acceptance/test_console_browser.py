"""The console in a real browser: headless Chromium (Debian's ``chromium`` package)
driven by Playwright, against ``outbox console`` running as a subprocess.

No browser is downloaded: Playwright launches the system Chromium by path. Where it or
Playwright is missing these tests skip with the reason, unless
``OUTBOX_REQUIRE_BROWSER=1`` (CI sets it), which turns the skip into a failure.

Screenshots of the operation page are saved under ``OUTBOX_TEST_ARTIFACTS`` (default:
the test's temporary directory); ``OUTBOX_UPDATE_SCREENSHOT=1`` also writes the one the
manual shows (docs/guide/command-line-and-console.md), ``docs/console-operation.png``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine

from outbox import Outbox
from outbox.reconcile import default_operator
from outbox.reconcile.history import endpoint_latency
from outbox.testing.receiver import Receiver
from tests.acceptance._console_proc import OUTBOX_SCRIPT, console_process
from tests.integration import _reconcile_states as S
from tests.integration._reconcile_states import LOST, World

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("OUTBOX_TEST_CHROMIUM", "/usr/bin/chromium")


def require_browser() -> None:
    reason = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        reason = f"playwright is not installed ({exc})"
    if reason is None and not Path(CHROMIUM).is_file():
        reason = f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    if reason is None:
        return
    if os.environ.get("OUTBOX_REQUIRE_BROWSER") == "1":
        pytest.fail(f"OUTBOX_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@contextmanager
def chromium_page(*, javascript: bool = True) -> Iterator[Any]:
    """A fresh page in headless Chromium; fails the test if the page logged an error (a
    CSP violation, a missing asset). Opened after the test's set-up: Playwright's sync
    API runs an event loop in this thread, so no asyncio.run() may start meanwhile."""
    require_browser()
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            context = browser.new_context(
                viewport={"width": 1280, "height": 900}, java_script_enabled=javascript
            )
            tab = context.new_page()
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            yield tab
            context.close()
        finally:
            browser.close()
    # 401 on the first visit is by design (the sign-in page); anything else is a fault.
    assert [e for e in errors if "401" not in e] == []


def artifact(tmp_path: Path, name: str) -> Path:
    directory = Path(os.environ.get("OUTBOX_TEST_ARTIFACTS") or tmp_path)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


def sign_in(page: Any, url: str, token: str) -> None:
    response = page.goto(url + "/")
    assert response.status == 401
    page.fill("#token", token)
    page.click("button:has-text('Sign in')")
    page.wait_for_selector("text=signed in as")


def audit_rows(db_url: str, operation_id: str) -> list[dict[str, Any]]:
    engine = create_engine(db_url)
    try:
        return S.audit_rows(engine, operation_id)
    finally:
        engine.dispose()


def test_sign_in_filter_the_queue_open_an_operation_and_resolve_it(tmp_path: Path) -> None:
    require_browser()
    db_url = f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    with Receiver(tmp_path / "receiver.sqlite3") as rx, S.every_state_world(World, db_url, rx):
        pass  # every state reached through real dispatches; the console reads the file
    # JavaScript off: every page and form must work without it.
    with console_process("--db", db_url) as console, chromium_page(javascript=False) as page:
        sign_in(page, console.url, console.token())
        assert page.inner_text(".tile.state-unresolved .n") == "3"
        # The overview's chart renders without script, within the CSP (no console
        # error), and its bars add up to the attempts the library counts.
        chart = page.locator("svg[data-chart=attempts-per-minute]")
        assert chart.count() == 1
        bars = page.locator("svg[data-chart=attempts-per-minute] rect[data-n]")
        total = sum(int(bars.nth(i).get_attribute("data-n")) for i in range(bars.count()))
        assert total == int(chart.get_attribute("data-total")) > 0
        # The queue-size and latency charts: drawn from the library's figures.
        queue = page.locator("svg[data-chart=queue-size]")
        assert queue.get_attribute("data-now") == "3"
        groups = page.locator("svg[data-chart=endpoint-latency] g[data-endpoint]")
        drawn = {
            groups.nth(i).get_attribute("data-endpoint"): int(
                groups.nth(i).get_attribute("data-count")
            )
            for i in range(groups.count())
        }
        with Outbox(db_url, auto_migrate=False) as ob:
            latency = endpoint_latency(ob, now_ms=ob.clock.now_ms())
        assert drawn == {e.endpoint: e.count for e in latency if e.count} != {}
        page.screenshot(path=str(artifact(tmp_path, "console-overview.png")), full_page=True)
        page.click("nav >> text=Reconciliation queue")
        assert page.inner_text("#total") == "3"
        page.select_option("select[name=reason]", "outcome_unknown")
        page.click("button:has-text('Filter')")
        assert "reason=outcome_unknown" in page.url
        assert page.inner_text("#total") == "1"
        assert page.locator("table.ops tbody tr").count() == 1
        page.click(f"table.ops >> text={LOST.operation_id}")
        page.wait_for_selector("h1.opid")
        assert LOST.operation_id in page.inner_text("h1.opid")
        explanation = page.inner_text(".explanation")
        assert "may have reached the receiver" in explanation
        assert page.locator("ol.timeline li").count() == 1
        # The time line: one dot per attempt, and the key's expiry from the snapshot.
        timeline = page.locator("svg[data-chart=timeline]")
        assert timeline.count() == 1
        assert page.locator("svg[data-chart=timeline] circle[data-attempt]").count() == 1
        assert timeline.get_attribute("data-key-expires")
        page.screenshot(path=str(artifact(tmp_path, "console-op-lost.png")), full_page=True)
        page.check("input[name=outcome][value=succeeded]")
        page.fill("#resolve-note", "reservation found in the receiver's admin")
        page.click("button:has-text('Resolve')")
        page.wait_for_selector(".notice.ok")
        assert "Resolved." in page.inner_text(".notice.ok")
        assert "succeeded" in page.inner_text("h1.opid")
        assert "reservation found" in page.inner_text("table.audit")
    [row] = audit_rows(db_url, LOST.operation_id)
    assert (row["actor"], row["action"], row["to_state"], row["note"]) == (
        default_operator(),
        "resolve",
        "succeeded",
        "reservation found in the receiver's admin",
    )


def test_an_endpoint_is_paused_and_resumed_from_the_endpoints_page(tmp_path: Path) -> None:
    """Issue 23: the fleet state in an operator's terms, and the maintenance switch,
    audited; checked in ``outbox_endpoints`` and ``outbox_audit``."""
    from sqlalchemy import select

    from outbox.store.tables import audit, endpoint_states

    require_browser()
    db_url = f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    with Receiver(tmp_path / "receiver.sqlite3") as rx, S.every_state_world(World, db_url, rx):
        pass
    engine = create_engine(db_url)
    with console_process("--db", db_url) as console, chromium_page(javascript=False) as page:
        sign_in(page, console.url, console.token())
        page.click("nav >> text=Endpoints")
        row = page.locator("tr[data-endpoint]").first
        name = row.get_attribute("data-endpoint")
        assert row.get_attribute("data-state") == "closed"
        assert name is not None and row.get_attribute("data-throttled") == "0"
        # The fleet's throttle, as a dispatcher writes it on a 429 that says 12/s.
        with Outbox(db_url) as ob:
            taught = {"initial": 12.0, "said": 12.0, "decrease": 0.8, "min_rate": 1.0}
            now = int(time.time() * 1000)
            ob.store.throttle(name, now_ms=now, interval_ms=1000, pause_until_ms=None, **taught)
        page.reload()
        row = page.locator(f"tr[data-endpoint='{name}']")
        assert row.get_attribute("data-throttled") == "1"
        assert row.get_attribute("data-rate") == "12.0"
        assert "12 req/s" in row.inner_text() and "throttled" in row.inner_text()
        row.locator("input[name=note]").fill("receiver maintenance window")
        row.locator("button:has-text('Pause')").click()
        page.wait_for_selector(".notice.ok")
        assert "Paused" in page.inner_text(".notice.ok")
        row = page.locator(f"tr[data-endpoint='{name}']")
        assert row.get_attribute("data-state") == "paused"
        assert "paused by " in row.inner_text()
        page.screenshot(path=str(artifact(tmp_path, "console-endpoints.png")), full_page=True)
        with engine.connect() as conn:
            paused = conn.execute(
                select(endpoint_states.c.paused).where(endpoint_states.c.name == name)
            ).scalar_one()
        assert paused == 1
        row.locator("input[name=note]").fill("maintenance over")
        row.locator("button:has-text('Resume')").click()
        page.wait_for_selector(".notice.ok")
        assert page.locator(f"tr[data-endpoint='{name}']").get_attribute("data-state") == "closed"
        page.click("nav >> text=Audit log")
        assert f"endpoint {name}" in page.inner_text("table.audit")
    with engine.connect() as conn:
        paused = conn.execute(
            select(endpoint_states.c.paused).where(endpoint_states.c.name == name)
        ).scalar_one()
        rows = conn.execute(
            select(audit.c.tenant, audit.c.operation_id, audit.c.action, audit.c.note)
            .where(audit.c.tenant == "@endpoint")
            .order_by(audit.c.id)
        ).all()
    engine.dispose()
    assert paused == 0
    assert [tuple(r) for r in rows] == [
        ("@endpoint", name, "pause", "receiver maintenance window"),
        ("@endpoint", name, "resume", "maintenance over"),
    ]


def test_the_readme_walkthrough_settles_the_demos_unresolved_operation(tmp_path: Path) -> None:
    require_browser()
    demo = tmp_path / "demo"
    done = subprocess.run(
        [str(OUTBOX_SCRIPT), "demo", "--dir", str(demo)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OUTBOX_DATABASE_URL": ""},
    )
    assert done.returncode == 0, done.stderr
    db_url = f"sqlite:///{demo / 'outbox.sqlite3'}"
    with console_process("--db", db_url) as console, chromium_page() as page:
        sign_in(page, console.url, console.token())
        page.click("nav >> text=Reconciliation queue")
        page.click("table.ops >> text=order-1004-reserve")
        page.wait_for_selector("h1.opid")
        # The evidence: every attempt with its request ID and what was observed.
        attempts = page.locator("ol.timeline li")
        assert attempts.count() >= 1
        assert "may have reached the receiver" in page.inner_text(".explanation")
        assert "TEST-AXLE" in page.inner_text("pre.json")
        shot = artifact(tmp_path, "console-operation.png")
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("OUTBOX_UPDATE_SCREENSHOT") == "1":
            shutil.copyfile(shot, REPO / "docs" / "console-operation.png")
        page.check("input[name=outcome][value=succeeded]")
        page.fill("#resolve-note", "reservation found in the inventory admin")
        page.click("button:has-text('Resolve')")
        page.wait_for_selector(".notice.ok")
    [row] = audit_rows(db_url, "order-1004-reserve")
    assert (row["action"], row["to_state"], row["note"]) == (
        "resolve",
        "succeeded",
        "reservation found in the inventory admin",
    )


def test_a_bulk_action_previews_then_applies_in_the_browser(tmp_path: Path) -> None:
    require_browser()
    db_url = f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    with Receiver(tmp_path / "receiver.sqlite3") as rx, S.every_state_world(World, db_url, rx):
        pass
    with console_process("--db", db_url) as console, chromium_page(javascript=False) as page:
        sign_in(page, console.url, console.token())
        page.goto(console.url + "/queue?tenant=acme")
        assert page.inner_text("#total") == "1"
        page.click("details.bulk summary")
        page.select_option("details.bulk select[name=action]", "resolve")
        page.select_option("details.bulk select[name=outcome]", "failed")
        page.fill("details.bulk textarea[name=note]", "supplier confirmed nothing was reserved")
        page.click("button:has-text('Preview')")
        page.wait_for_selector("table.bulk")
        assert "would change: 1" in page.inner_text(".summary")
        assert audit_rows(db_url, S.BUSY.operation_id) == []  # the preview wrote nothing
        page.click("button:has-text('Apply to 1')")
        page.wait_for_selector("text=Bulk resolve: done")
        assert "changed: 1" in page.inner_text(".summary")
    [row] = audit_rows(db_url, S.BUSY.operation_id)
    assert (row["action"], row["to_state"], row["note"]) == (
        "resolve",
        "failed",
        "supplier confirmed nothing was reserved",
    )


def test_a_bulk_action_over_1600_operations_in_the_browser(tmp_path: Path) -> None:
    """1,600 unresolved operations (more than the apply form could once carry): one
    preview, the apply in pages with its progress, one audit row per operation with the
    filters (issue 29). JavaScript off."""
    import json

    from sqlalchemy import func, select

    from outbox.console.views import BULK_PAGE
    from outbox.store.tables import audit, operations
    from tests.integration.test_console_bulk_pages import N, _build

    require_browser()
    db_url = f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    _build(db_url)
    progress = []
    with console_process("--db", db_url) as console, chromium_page(javascript=False) as page:
        sign_in(page, console.url, console.token())
        page.goto(console.url + "/queue?tenant=acme")
        assert page.inner_text("#total") == str(N)
        page.click("details.bulk summary")
        page.select_option("details.bulk select[name=action]", "resolve")
        page.select_option("details.bulk select[name=outcome]", "failed")
        page.fill("details.bulk textarea[name=note]", "supplier closed")
        page.click("button:has-text('Preview')")
        page.wait_for_selector("table.bulk")
        assert f"would change: {N}" in page.inner_text(".summary")
        page.screenshot(path=str(artifact(tmp_path, "console-bulk-preview.png")))
        page.click(f"button:has-text('Apply to {N}')")
        while True:
            page.wait_for_selector("#bulk-progress")
            progress.append(page.inner_text("#bulk-progress"))
            if page.locator("button:has-text('Continue')").count() == 0:
                break
            page.click("button:has-text('Continue')")
        page.screenshot(path=str(artifact(tmp_path, "console-bulk-done.png")))
    pages = -(-N // BULK_PAGE)
    assert progress == [f"{min(BULK_PAGE * (i + 1), N)} of {N} done" for i in range(pages)]
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            failed = conn.execute(
                select(func.count()).select_from(operations).where(operations.c.state == "failed")
            ).scalar_one()
            details = conn.execute(select(audit.c.details)).scalars().all()
    finally:
        engine.dispose()
    assert failed == N
    assert len(details) == N
    assert all(json.loads(d)["bulk"] == {"tenant": "acme", "view": "queue"} for d in details)
