"""The web console's handlers, through Starlette's test client, on SQLite and PostgreSQL.

The database holds an operation in every state, each reached through real dispatches
against a real receiver on 127.0.0.1 (``_reconcile_states``). Every action is checked
where it lands (the outbox tables, the audit rows); every refusal is checked to leave
the three tables byte-identical.
"""

from __future__ import annotations

import html
import json
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from outbox import Endpoint, FakeClock, Outbox, RetryPolicy
from outbox.config import StatusLookup
from outbox.console import Credentials, create_app
from outbox.console.app import CSP, SESSION_COOKIE
from outbox.testing.receiver import Receiver
from tests.integration import _reconcile_states as S
from tests.integration._reconcile_states import BUSY, DARK, LOST, OK, WAIT, World

ALICE = "alice-" + "a" * 20
BOB = "bob-" + "b" * 20
CREDENTIALS = f"alice:{ALICE}\n# a comment\nbob:{BOB}\n"
BASE = "http://127.0.0.1"
PAGES = ("/", "/queue", "/operations", "/audit", "/operation?tenant=acme&id=op-busy")


def creds(text: str = CREDENTIALS) -> Credentials:
    return Credentials.parse(text, default_name="nobody", source="test")


def client(ob: Outbox, *, token: str | None = ALICE, **kw: Any) -> TestClient:
    c = TestClient(create_app(ob, kw.pop("credentials", creds()), **kw), base_url=BASE)
    if token is not None:
        r = c.post("/login", data={"token": token}, follow_redirects=False)
        assert r.status_code == 303, r.text
    return c


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, "no CSRF field on the page"
    return match.group(1)


def version_of(page: str) -> int:
    # The action forms carry it; pages without a form show it in the header line.
    match = re.search(r'name="version" value="(\d+)"', page) or re.search(
        r"version (\d+)</p>", page
    )
    assert match, "no version on the page"
    return int(match.group(1))


def apply_fields(page: str) -> dict[str, list[str]]:
    """The hidden fields of a bulk page's apply (or Continue) form."""
    form = page[page.index('<form method="post" action="/bulk" class="card">') :]
    form = form[: form.index("</form>")]
    fields: dict[str, list[str]] = {}
    for name, value in re.findall(r'name="([^"]+)" value="([^"]*)"', form):
        fields.setdefault(name, []).append(value)
    return fields


def op_path(ref: S.Ref) -> str:
    return f"/operation?tenant={ref.tenant}&id={ref.operation_id}"


def form_for(c: TestClient, ref: S.Ref, **fields: str) -> dict[str, str]:
    """The hidden fields of the operation page's forms, plus ``fields``."""
    page = c.get(op_path(ref)).text
    return {
        "csrf": csrf_of(page),
        "tenant": ref.tenant,
        "id": ref.operation_id,
        "version": str(version_of(page)),
        **fields,
    }


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def world(db_url: str, receiver: Receiver) -> Iterator[World]:
    with S.every_state_world(World, db_url, receiver) as w:
        yield w


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def shared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    """One world per database for the tests that only read or are refused."""
    directory = tmp_path_factory.mktemp(f"console-{request.param}")
    with (
        S.database(request.param, directory) as url,
        Receiver(directory / "receiver.sqlite3") as rx,
        S.every_state_world(World, url, rx) as w,
    ):
        yield w


# -- sign-in, sessions, headers ----------------------------------------------------------


def test_every_page_and_action_needs_a_session(shared: World) -> None:
    c = client(shared.ob, token=None)
    before = shared.rows()
    for path in PAGES:
        r = c.get(path)
        assert r.status_code == 401, path
        assert 'action="/login"' in r.text and "order" not in r.text
    for path in ("/operation/resolve", "/operation/requeue", "/operation/cancel", "/bulk"):
        r = c.post(path, data={"tenant": "acme", "id": "op-busy", "version": "0", "note": "x"})
        assert r.status_code == 401, path
    # A made-up session cookie is no session.
    c.cookies.set(SESSION_COOKIE, "forged")
    assert c.get("/").status_code == 401
    assert shared.rows() == before


def test_sign_in_sets_an_httponly_strict_cookie_and_a_bad_token_gets_401(shared: World) -> None:
    c = client(shared.ob, token=None)
    r = c.post("/login", data={"token": ALICE[:-1] + "z"}, follow_redirects=False)
    assert r.status_code == 401 and "not valid" in r.text
    assert SESSION_COOKIE not in r.headers.get("set-cookie", "")
    r = c.post("/login", data={"token": ALICE, "next": "/queue"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/queue"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Secure" not in cookie
    assert c.get("/").status_code == 200
    # Over TLS the cookie is Secure; an off-site "next" never redirects away.
    tls = TestClient(create_app(shared.ob, creds()), base_url="https://127.0.0.1")
    r = tls.post("/login", data={"token": BOB, "next": "//evil.example/x"}, follow_redirects=False)
    assert "Secure" in r.headers["set-cookie"] and r.headers["location"] == "/"
    # Signing out ends the session on the server, not only in the browser.
    sid = c.cookies.get(SESSION_COOKIE)
    page = c.get("/").text
    assert (
        c.post("/logout", data={"csrf": csrf_of(page)}, follow_redirects=False).status_code == 303
    )
    c.cookies.set(SESSION_COOKIE, sid or "")
    assert c.get("/").status_code == 401


def test_every_response_carries_the_security_headers_and_no_script(shared: World) -> None:
    c = client(shared.ob)
    for path in (*PAGES, "/login", "/static/console.css"):
        r = c.get(path)
        assert r.headers["content-security-policy"] == CSP, path
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
        assert "<script" not in r.text.lower()
    assert "unsafe-inline" not in CSP and "script-src" not in CSP  # default-src 'none'


def test_a_foreign_host_header_is_refused_when_hosts_are_pinned(shared: World) -> None:
    app = create_app(shared.ob, creds(), allowed_hosts=["127.0.0.1"])
    assert TestClient(app, base_url="http://127.0.0.1").get("/login").status_code == 200
    assert TestClient(app, base_url="http://rebound.example").get("/login").status_code == 400


# -- pages --------------------------------------------------------------------------------


def test_overview_counts_states_reasons_backlog_and_attempts(shared: World) -> None:
    page = client(shared.ob).get("/").text
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    for state, n in S.state_counts(shared.ob.engine).items():
        assert re.search(rf'class="n">{n}</span><span class="label">{state}<', page), state
    for reason in ("retries_exhausted", "outcome_unknown", "never_delivered"):
        assert f"/queue?reason={reason}" in page
    assert "3 unresolved operations" in text
    assert "Attempts in the last hour" in page and "unknown" in text and "success" in text
    # The per-endpoint backlog: the in-flight and unresolved operations of each endpoint.
    offline = re.search(r"<td>offline</td>(.*?)</tr>", page, re.S)
    assert offline and re.findall(r">([^<]*)</td>", offline.group(1))[3] == "1"  # unresolved
    assert "No dispatcher has reported" in page


def test_overview_lists_dispatcher_heartbeats_when_there_are_any(world: World) -> None:
    from outbox.store.tables import dispatchers

    now = world.clock.now_ms()
    with world.ob.engine.begin() as conn:  # as a dispatcher's heartbeat writes them
        conn.execute(
            dispatchers.insert(),
            [
                {
                    "id": "vm:1:live",
                    "host": "vm",
                    "pid": 1,
                    "version": "0.1.0",
                    "concurrency": 32,
                    "in_flight": 5,
                    "started_at": now - 60_000,
                    "last_seen_at": now - 1_000,
                    "stopped_at": None,
                },
                {
                    "id": "vm:2:gone",
                    "host": "vm",
                    "pid": 2,
                    "version": "0.1.0",
                    "concurrency": 32,
                    "in_flight": 0,
                    "started_at": now - 600_000,
                    "last_seen_at": now - 300_000,
                    "stopped_at": None,
                },
            ],
        )
    page = client(world.ob).get("/").text
    assert "<strong>1 live</strong> (heartbeat within 30s)" in page
    assert re.search(r'vm:1:live</td><td><span class="pill dispatcher-live">live<', page)
    assert re.search(r'vm:2:gone</td><td><span class="pill dispatcher-lost">lost<', page)
    assert "5/32" in page


def test_queue_lists_only_unresolved_with_totals_filters_and_paging(shared: World) -> None:
    c = client(shared.ob)

    def ids(path: str) -> list[str]:
        page = c.get(path)
        assert page.status_code == 200, page.text
        return re.findall(r'<td class="mono"><a href="[^"]+">([^<]+)</a>', page.text)

    assert sorted(ids("/queue")) == sorted(r.operation_id for r in S.UNRESOLVED)
    assert 'id="total">3<' in c.get("/queue").text
    assert ids("/queue?reason=outcome_unknown") == [LOST.operation_id]
    assert ids("/queue?endpoint=offline") == [DARK.operation_id]
    assert ids("/queue?tenant=acme") == [BUSY.operation_id]
    assert ids("/queue?tenant=(none)") == [DARK.operation_id]
    assert ids("/queue?q=los") == [LOST.operation_id]
    assert ids("/queue?q=%25") == []  # LIKE wildcards match themselves
    assert ids("/queue?older_than=30d") == []
    assert len(ids("/queue?older_than=0s")) == 3
    # The queue ignores a state filter: it is the unresolved operations, always.
    assert len(ids("/queue?state=succeeded")) == 3
    everything = ids("/operations?limit=25")
    assert len(everything) == len(S.EVERY)
    assert ids("/operations?sort=newest&limit=25") == list(reversed(everything))
    assert ids("/operations?state=succeeded") == [OK.operation_id]
    # Paging: 25 per page of 8 is one page; the totals say so.
    page = c.get("/operations?limit=25").text
    assert 'id="total">8<' in page and 'rel="next"' not in page
    r = c.get("/operations?older_than=yesterday")
    assert r.status_code == 400 and "duration must look like" in html.unescape(r.text)
    assert c.get("/operations?state=bogus").status_code == 400
    assert c.get("/operations?limit=7").status_code == 400


def test_paging_walks_every_operation_once(db_url: str, receiver: Receiver) -> None:
    with S.every_state_world(World, db_url, receiver, build=False) as w:
        for n in range(60):
            w.ob.enqueue(
                endpoint="inventory",
                method="POST",
                path="/p",
                json={"n": n},
                operation_id=f"bulk-{n:03d}",
            )
        c = client(w.ob)
        seen: list[str] = []
        path: str | None = "/operations?limit=25"
        while path:
            page = c.get(path).text
            assert 'id="total">60<' in page
            seen += re.findall(r'<td class="mono"><a href="[^"]+">([^<]+)</a>', page)
            match = re.search(r'href="([^"]+)" rel="next"', page)
            path = html.unescape(match.group(1)) if match else None
        assert seen == [f"bulk-{n:03d}" for n in range(60)]


def test_operation_page_shows_intent_attempts_explanation_risk_and_audit(shared: World) -> None:
    c = client(shared.ob)
    for ref in S.EVERY:
        r = c.get(op_path(ref))
        assert r.status_code == 200, ref
        op = shared.ob.get(ref.operation_id, tenant=ref.tenant)
        report = shared.ob.reconcile.show(ref.operation_id, tenant=ref.tenant)
        page = html.unescape(r.text)
        assert report.explanation in page
        assert f"POST {op.path}" in page and '"quantity": 2' in page
        for attempt in op.attempts:
            assert attempt.request_id in page
        if op.state.value == "unresolved":
            assert report.requeue_risk.note in page
            assert 'action="/operation/resolve"' in page
        else:
            assert 'action="/operation/resolve"' not in page
    cancelled = html.unescape(c.get(op_path(S.CANCELLED)).text)
    assert "customer withdrew the order" in cancelled and "cancel" in cancelled
    # Cancel is offered for the pending operation never sent, and nothing else.
    assert 'action="/operation/cancel"' in c.get(op_path(WAIT)).text
    assert 'action="/operation/cancel"' not in c.get(op_path(S.STUCK)).text
    r = c.get("/operation?tenant=acme&id=nope")
    assert r.status_code == 404
    assert c.get("/operation?tenant=acme&id=bad%20id").status_code == 400


def test_ordering_key_blocker_links_to_the_operation_it_waits_for(
    db_url: str, receiver: Receiver
) -> None:
    with S.every_state_world(World, db_url, receiver, build=False) as w:
        S.enqueue(w.ob, S.Ref("", "first", "offline", "pending"), ordering_key="order-7")
        S.enqueue(w.ob, S.Ref("", "second", "offline", "pending"), ordering_key="order-7")
        page = client(w.ob).get("/operation?tenant=&id=second").text
        assert 'href="/operation?tenant=&amp;id=first">first</a>' in page
        assert "same ordering key (order-7)" in page


def test_audit_log_filters_by_actor_and_time(world: World) -> None:
    c = client(world.ob)
    c.post("/operation/resolve", data=form_for(c, LOST, outcome="succeeded", note="seen"))
    b = client(world.ob, token=BOB)
    b.post("/operation/resolve", data=form_for(b, BUSY, outcome="failed", note="refused"))
    page = c.get("/audit").text
    assert 'id="total">3<' in page  # the two resolves and the set-up's cancel
    assert re.findall(r'<td class="actor">([^<]+)<', page)[:2] == ["bob", "alice"]
    only_bob = c.get("/audit?actor=bob").text
    assert 'id="total">1<' in only_bob and "refused" in only_bob
    assert 'id="total">0<' in c.get("/audit?since=2999-01-01T00:00").text
    assert 'id="total">3<' in c.get("/audit?within=1h").text
    assert 'id="total">0<' in c.get("/audit?until=2000-01-01T00:00").text
    assert c.get("/audit?since=not-a-date").status_code == 400


# -- actions ------------------------------------------------------------------------------


def test_resolve_is_audited_under_the_credentials_name_never_a_form_field(world: World) -> None:
    c = client(world.ob, token=BOB)
    data = form_for(c, LOST, outcome="succeeded", note="found it in the inventory admin")
    r = c.post(
        "/operation/resolve",
        data={**data, "operator": "mallory", "actor": "mallory"},
        follow_redirects=False,
    )
    assert r.status_code == 303
    assert r.headers["location"] == "/operation?tenant=globex&id=op-lost&done=resolved"
    assert world.ob.get(LOST.operation_id, tenant=LOST.tenant).state.value == "succeeded"
    [row] = world.audit(LOST.operation_id)
    assert (row["actor"], row["action"], row["from_state"], row["to_state"], row["note"]) == (
        "bob",
        "resolve",
        "unresolved",
        "succeeded",
        "found it in the inventory admin",
    )
    after = c.get(r.headers["location"]).text
    assert "Resolved." in after and 'class="actor">bob<' in after


def test_requeue_within_retention_then_cancel_a_pending_one(world: World) -> None:
    c = client(world.ob)
    page = c.get(op_path(LOST)).text
    assert "accept_duplicate_risk" not in page  # the receiver still remembers the key
    r = c.post(
        "/operation/requeue",
        data=form_for(c, LOST, note="receiver has no record"),
        follow_redirects=False,
    )
    assert r.status_code == 303
    assert world.ob.get(LOST.operation_id, tenant=LOST.tenant).state.value == "pending"
    r = c.post(
        "/operation/cancel", data=form_for(c, WAIT, note="withdrawn"), follow_redirects=False
    )
    assert r.status_code == 303
    assert world.ob.get(WAIT.operation_id, tenant=WAIT.tenant).state.value == "cancelled"
    assert [a["action"] for a in world.audit()][-2:] == ["requeue", "cancel"]


def test_requeue_after_key_retention_spells_out_the_risk_and_needs_the_box(
    world: World,
) -> None:
    later = world.outbox_at(world.clock.now_ms() + int((S.RETENTION * 2).total_seconds() * 1000))
    try:
        c = client(later)
        page = html.unescape(c.get(op_path(LOST)).text)
        assert "Duplicate risk." in page and "applied twice" in page
        assert "key retention has passed" in page
        before = world.rows()
        r = c.post("/operation/requeue", data=form_for(c, LOST, note="checked"))
        assert r.status_code == 409 and "refusing to requeue" in html.unescape(r.text)
        assert world.rows() == before
        r = c.post(
            "/operation/requeue",
            data=form_for(c, LOST, note="checked: not applied", accept_duplicate_risk="yes"),
            follow_redirects=False,
        )
        assert r.status_code == 303
        [row] = world.audit(LOST.operation_id)
        assert '"accept_duplicate_risk": true' in row["details"]
    finally:
        later.close()


def test_refusals_say_why_and_leave_every_table_byte_identical(shared: World) -> None:
    c = client(shared.ob)
    before = shared.rows()
    cases: list[tuple[str, dict[str, str], int, str]] = [
        ("resolve", form_for(c, LOST, outcome="succeeded", note="  "), 400, "a note is required"),
        ("resolve", form_for(c, LOST, note="x"), 400, "choose the outcome"),
        ("resolve", form_for(c, LOST, outcome="pending", note="x"), 400, "choose the outcome"),
        ("resolve", form_for(c, OK, outcome="failed", note="x"), 409, "not unresolved"),
        ("requeue", form_for(c, OK, note="x"), 409, "not unresolved"),
        ("cancel", form_for(c, LOST, note="x"), 409, "only pending operations"),
        ("cancel", form_for(c, S.STUCK, note="x"), 409, "only pending operations"),
        ("resolve", {**form_for(c, LOST, outcome="failed"), "note": "n" * 2001}, 400, "longer"),
        (
            "resolve",
            {**form_for(c, LOST, outcome="failed", note="x"), "id": "nope"},
            404,
            "no operation",
        ),
        (
            "resolve",
            {**form_for(c, LOST, outcome="failed", note="x"), "version": "x"},
            400,
            "whole number",
        ),
        ("launch", form_for(c, LOST, note="x"), 400, "unknown action"),
        ("probe", form_for(c, LOST), 400, "no status_lookup"),
    ]
    for action, data, status, words in cases:
        r = c.post(f"/operation/{action}", data=data)
        assert (r.status_code, words in html.unescape(r.text)) == (status, True), (action, data)
        assert "Nothing was changed" in r.text or "nothing was" in r.text
    assert shared.rows() == before


def test_a_post_without_the_csrf_token_or_from_another_origin_gets_403(shared: World) -> None:
    c = client(shared.ob)
    before = shared.rows()
    data = form_for(c, LOST, outcome="succeeded", note="x")
    for bad in ({k: v for k, v in data.items() if k != "csrf"}, {**data, "csrf": "guess"}):
        assert c.post("/operation/resolve", data=bad).status_code == 403
    r = c.post("/operation/resolve", data=data, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    r = c.post("/bulk", data={"step": "preview", "action": "resolve", "note": "x"})
    assert r.status_code == 403
    # Another session's token is not this session's.
    other = client(shared.ob, token=BOB)
    assert other.post("/operation/resolve", data=data).status_code == 403
    # GET never changes anything, whatever it carries.
    assert c.get("/operation/resolve").status_code == 405
    assert shared.rows() == before


def test_an_action_on_an_operation_changed_since_it_was_shown_is_refused(world: World) -> None:
    c = client(world.ob)
    stale = form_for(c, LOST, outcome="failed", note="from a stale page")
    # Someone else acts first (the CLI, another console user: the library either way).
    world.ob.reconcile.resolve(
        LOST.operation_id,
        tenant=LOST.tenant,
        outcome="succeeded",
        note="bob was faster",
        operator="bob",
    )
    before = world.rows()
    r = c.post("/operation/resolve", data=stale)
    assert r.status_code == 409
    page = html.unescape(r.text)
    assert "Changed since you looked" in page and "changed since it was shown" in page
    assert 'href="/operation?tenant=globex&id=op-lost">See the current state' in page
    assert world.rows() == before
    assert [a["note"] for a in world.audit(LOST.operation_id)] == ["bob was faster"]


def test_an_oversized_form_is_refused_before_it_is_read(shared: World) -> None:
    c = client(shared.ob)
    before = shared.rows()
    data = form_for(c, LOST, outcome="succeeded", note="x" * 300_000)
    r = c.post("/operation/resolve", data=data)
    assert r.status_code == 413
    assert r.headers["content-security-policy"] == CSP
    assert shared.rows() == before


def test_a_large_body_is_shown_cut_with_its_size(db_url: str, receiver: Receiver) -> None:
    with S.every_state_world(World, db_url, receiver, build=False) as w:
        big = {"items": ["x" * 100 for _ in range(1000)]}
        w.ob.enqueue(
            endpoint="offline", method="POST", path="/big", json=big, operation_id="op-big"
        )
        page = client(w.ob).get("/operation?tenant=&id=op-big").text
        assert "Cut at 65536 characters of" in page
        shown = re.search(r'<pre class="json">(.*?)</pre>', page, re.S)
        assert shown and len(html.unescape(shown.group(1))) == 65536


def test_a_database_failure_is_a_503_page_not_a_traceback(tmp_path: Path) -> None:
    from sqlalchemy import text

    with Outbox(f"sqlite:///{tmp_path / 'o.sqlite3'}") as ob:
        c = client(ob)
        assert c.get("/audit").status_code == 200
        with ob.engine.begin() as conn:  # a real fault: the table is gone
            conn.execute(text("DROP TABLE outbox_audit"))
        r = c.get("/audit")
        assert r.status_code == 503 and "The database failed" in r.text
        assert "no such table" in r.text and "Traceback" not in r.text


def test_read_only_console_shows_no_action_and_refuses_every_post(shared: World) -> None:
    c = client(shared.ob, read_only=True)
    page = c.get(op_path(LOST)).text
    assert "read-only" in page
    for form in ("/operation/resolve", "/operation/requeue", "/bulk"):
        assert f'action="{form}"' not in page
    assert 'action="/bulk"' not in c.get("/queue").text
    before = shared.rows()
    data = {
        "csrf": csrf_of(page),
        "tenant": LOST.tenant,
        "id": LOST.operation_id,
        "version": "0",
        "outcome": "succeeded",
        "note": "x",
    }
    for path in ("/operation/resolve", "/operation/requeue", "/operation/cancel", "/bulk"):
        assert c.post(path, data=data).status_code == 403, path
    assert shared.rows() == before


# -- bulk ---------------------------------------------------------------------------------


def test_bulk_preview_changes_nothing_and_apply_reports_each_operation(world: World) -> None:
    c = client(world.ob)
    csrf = csrf_of(c.get("/queue").text)
    before = world.rows()
    r = c.post(
        "/bulk",
        data={
            "csrf": csrf,
            "step": "preview",
            "view": "queue",
            "action": "resolve",
            "outcome": "failed",
            "note": "supplier closed",
            "tenant": "acme",
        },
    )
    assert r.status_code == 200 and "preview" in r.text
    assert world.rows() == before
    assert "would change: 1" in r.text and "Apply to 1</button>" in r.text
    assert f">{BUSY.operation_id}</a>" in r.text
    # Preview every unresolved one for requeue: the library says which may go.
    r = c.post(
        "/bulk",
        data={
            "csrf": csrf,
            "step": "preview",
            "view": "queue",
            "action": "requeue",
            "note": "retry all",
            "older_than": "0s",
        },
    )
    assert world.rows() == before
    rows = dict(
        re.findall(
            r'<a href="[^"]+">([^<]+)</a></td>\s*<td>[^<]*</td><td>([^<]+)</td>',
            r.text,
        )
    )
    # The CLI's words: would change, refused, changed by someone else.
    assert rows == {op.operation_id: "would change" for op in S.UNRESOLVED}
    # The apply form names the preview's plan, not each operation (no form grows with
    # the selection); the plan keeps the previewed filters for the audit rows.
    apply = apply_fields(r.text)
    assert set(apply) == {"csrf", "step", "plan", "at"} and apply["at"] == ["0"]
    # Apply, with one operation changed between the preview and the apply.
    world.ob.reconcile.resolve(
        DARK.operation_id, tenant=DARK.tenant, outcome="failed", note="meanwhile", operator="bob"
    )
    r = c.post("/bulk", data=apply)
    assert r.status_code == 200
    result = html.unescape(r.text)
    assert "changed: 2" in result and "changed by someone else: 1" in result
    states = {
        ref.operation_id: world.ob.get(ref.operation_id, tenant=ref.tenant).state.value
        for ref in S.UNRESOLVED
    }
    assert states == {
        BUSY.operation_id: "pending",
        LOST.operation_id: "pending",
        DARK.operation_id: "failed",
    }
    actors = {(a["operation_id"], a["actor"], a["action"]) for a in world.audit()}
    assert (BUSY.operation_id, "alice", "requeue") in actors
    assert (DARK.operation_id, "alice", "requeue") not in actors
    # Each audit row records the filters, as the CLI's bulk actions do.
    rows = [a for a in world.audit() if a["actor"] == "alice" and a["action"] == "requeue"]
    assert len(rows) == 2
    for row in rows:
        details = json.loads(row["details"]) if isinstance(row["details"], str) else row["details"]
        assert details["bulk"] == {"older_than": "0s", "view": "queue"}
        assert details["via"] == "console"


def test_bulk_refusals_change_nothing(shared: World) -> None:
    c = client(shared.ob)
    csrf = csrf_of(c.get("/queue").text)
    before = shared.rows()
    for data, words in (
        ({"action": "resolve", "note": "x", "step": "preview"}, "needs an outcome"),
        ({"action": "resolve", "outcome": "failed", "note": " ", "step": "preview"}, "a note"),
        ({"action": "explode", "note": "x", "step": "preview"}, "bulk action must be"),
        ({"step": "apply"}, "that bulk preview is gone"),
        ({"step": "apply", "plan": "made-up", "at": "0"}, "that bulk preview is gone"),
        ({"step": "apply", "plan": "made-up", "at": "x"}, "at must be a whole number"),
        ({"step": "explode"}, "step is preview or apply"),
    ):
        r = c.post("/bulk", data={"csrf": csrf, **data})
        assert r.status_code == 400 and words in html.unescape(r.text), data
    # Cancel previewed over the queue: every line refused by the library's rule.
    r = c.post(
        "/bulk",
        data={"csrf": csrf, "step": "preview", "view": "queue", "action": "cancel", "note": "x"},
    )
    assert "refused: 3" in r.text and 'name="plan"' not in r.text
    # Grouped as the CLI groups them: one line per reason, with the first IDs.
    assert "<li>refused 3: is unresolved (" in html.unescape(r.text)
    assert shared.rows() == before


# -- probe --------------------------------------------------------------------------------


def _lookup_endpoint(url: str) -> Endpoint:
    return Endpoint(
        name="rx",
        base_url=url,
        timeout=1.0,
        retry=RetryPolicy(max_attempts=1, window=timedelta(seconds=30)),
        key_retention=timedelta(hours=1),
        status_lookup=StatusLookup(on_unresolved=False),
        throttle=None,  # a 503 makes "op-refused" unresolved (under the throttle it waits)
    )


def test_bulk_probe_previews_then_settles_each_by_the_receivers_answer(
    db_url: str, receiver: Receiver
) -> None:
    receiver.faults.drop_after_commit(key="op-applied", times=1)
    receiver.faults.fail_before_work(503, key="op-refused", retry_after=None, times=None)
    with Outbox(db_url, endpoints=[_lookup_endpoint(receiver.url)], clock=FakeClock()) as ob:
        for op_id in ("op-applied", "op-refused"):
            ob.enqueue(
                endpoint="rx",
                method="POST",
                path="/reservations",
                json={"id": op_id},
                operation_id=op_id,
            )
        ob.dispatch_once()
        receiver.faults.clear()
        assert {ob.get(i).state.value for i in ("op-applied", "op-refused")} == {"unresolved"}
        c = client(ob)
        csrf = csrf_of(c.get("/queue").text)
        before = S.table_rows(ob.engine)
        r = c.post(
            "/bulk",
            data={"csrf": csrf, "step": "preview", "view": "queue", "action": "probe", "note": ""},
        )
        assert r.status_code == 200 and "would change: 2" in r.text
        assert S.table_rows(ob.engine) == before
        r = c.post("/bulk", data=apply_fields(r.text))
        assert r.status_code == 200 and "changed: 2" in r.text
        assert "resolved_succeeded" in r.text and "requeued" in r.text
        assert ob.get("op-applied").state.value == "succeeded"
        assert ob.get("op-refused").state.value == "pending"
        assert receiver.effect_count(key="op-applied") == 1
        assert receiver.effect_count(key="op-refused") == 0
        assert {a["actor"] for a in S.audit_rows(ob.engine)} == {"status-lookup"}


def test_probe_asks_the_receiver_and_settles_what_it_answers(
    db_url: str, receiver: Receiver
) -> None:
    endpoint = _lookup_endpoint(receiver.url)
    receiver.faults.drop_after_commit(key="op-probed", times=1)
    with Outbox(db_url, endpoints=[endpoint], clock=FakeClock()) as ob:
        ob.enqueue(
            endpoint="rx",
            method="POST",
            path="/reservations",
            json={"n": 1},
            operation_id="op-probed",
        )
        ob.dispatch_once()
        assert ob.get("op-probed").state.value == "unresolved"
        c = client(ob)
        ref = S.Ref("", "op-probed", "rx", "unresolved")
        assert 'action="/operation/probe"' in c.get(op_path(ref)).text
        r = c.post("/operation/probe", data=form_for(c, ref))
        assert r.status_code == 200
        assert "resolved_succeeded" in r.text
        assert ob.get("op-probed").state.value == "succeeded"
        assert receiver.effect_count(key="op-probed") == 1


# -- hostile strings and secrets ------------------------------------------------------------

HOSTILE = ('<script>alert("x")</script>', '"><img src=x onerror=alert(1)>')


class _HostileReceiver(BaseHTTPRequestHandler):
    """Answers every request 400 with hostile text in the body and evidence headers."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = (HOSTILE[0] + " " + HOSTILE[1]).encode()
        self.send_response(400)
        self.send_header("content-type", "text/plain")
        self.send_header("x-request-id", HOSTILE[1])
        self.send_header("set-cookie", "session=super-secret-cookie-value")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def hostile_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HostileReceiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_every_stored_string_renders_as_text_and_secret_headers_are_masked(
    db_url: str, receiver: Receiver, hostile_url: str
) -> None:
    endpoints = [
        Endpoint(
            name="hostile",
            base_url=hostile_url,
            timeout=2.0,
            retry=RetryPolicy(max_attempts=1, window=timedelta(seconds=30)),
            key_retention=timedelta(hours=1),
            evidence_headers=("x-request-id", "set-cookie", "content-type"),
        ),
        Endpoint(
            name="fine",
            base_url=receiver.url,
            timeout=2.0,
            retry=RetryPolicy(max_attempts=1, window=timedelta(seconds=30)),
            key_retention=timedelta(hours=1),
        ),
    ]
    receiver.faults.drop_after_commit(key="op-fine", times=1)
    with Outbox(db_url, endpoints=endpoints, clock=FakeClock()) as ob:
        hostile_json = {"note": HOSTILE[0], "attr": HOSTILE[1], HOSTILE[0]: HOSTILE[1]}
        ob.enqueue(
            endpoint="hostile",
            method="POST",
            path="/x<script>alert(1)</script>",
            json=hostile_json,
            headers={"x-note": HOSTILE[1]},
            operation_id="op-hostile",
        )
        ob.enqueue(
            endpoint="fine",
            method="POST",
            path="/reservations",
            json=hostile_json,
            headers={"x-note": HOSTILE[0]},
            operation_id="op-fine",
        )
        ob.dispatch_once()
        assert ob.get("op-hostile").result is not None
        assert ob.get("op-hostile").result.headers.get("set-cookie")  # type: ignore[union-attr]
        # The operator's name (from the credential) and note are stored strings too.
        c = client(ob, credentials=creds(f'<b onmouseover="x">eve</b>:{ALICE}'))
        ref = S.Ref("", "op-fine", "fine", "unresolved")
        c.post(
            "/operation/resolve", data=form_for(c, ref, outcome="failed", note=" ".join(HOSTILE))
        )
        pages = {
            path: c.get(path).text
            for path in (
                "/",
                "/queue",
                "/operations",
                "/audit",
                "/operation?tenant=&id=op-hostile",
                "/operation?tenant=&id=op-fine",
            )
        }
    for path, page in pages.items():
        lowered = page.lower()
        assert "<script" not in lowered and "<img" not in lowered and "<b " not in lowered, path
        assert "super-secret-cookie-value" not in page, path
    fine, hostile = (
        pages["/operation?tenant=&id=op-fine"],
        pages["/operation?tenant=&id=op-hostile"],
    )
    escaped_script = html.escape(HOSTILE[0], quote=False)
    assert escaped_script in fine.replace("&#34;", '"').replace("&quot;", '"')
    assert "&lt;img src=x onerror=alert(1)&gt;" in hostile  # evidence header and body
    assert "/x&lt;script&gt;alert(1)&lt;/script&gt;" in hostile  # the path
    assert "(masked)" in hostile  # set-cookie evidence
    # The receiver's own words (its error text, its request ID), escaped where they show.
    planted = "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;"
    # (kept as "header: value", the header the receiver named it in)
    assert (
        f'<dt>receiver\'s request ID</dt><dd class="mono">x-request-id: {planted}</dd>' in hostile
    )
    assert (
        '<dd class="mono error">&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; ' + planted
    ) in hostile
    assert "&lt;b onmouseover=" in pages["/audit"]  # the actor
