"""The contracts of the two background articles, restated through outbox's public API.

Every test sends real HTTP to the real test :class:`Receiver` and reads the effects from
the receiver's own store: the effect rows, receipts and request log, or the versioned
settings rows of the second half. Responses are never the oracle.

Each test runs its scenario twice: once with a correct client (an ``Outbox`` as
documented) and once with a deliberately broken client or receiver, built inside the
test (a raw httpx loop, an ``httpx.Auth`` that rewrites the key, a subclass, a handler
writing outside the receipt transaction). The broken run must be caught by the same
oracle; a test whose oracle cannot tell the two apart proves nothing.

Tests that involve the outbox's own database run on SQLite and on PostgreSQL (``db_url``),
and every contract runs against each receiver dialect (``outbox.testing.dialects``: the
same behaviour worded as the IETF draft, the article, Stripe, FastAPI middlewares, or a
replay answered 409). Time is a FakeClock: backoff is crossed by advancing it, never by
sleeping.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sqlite3
import threading
import uuid
from collections.abc import Callable, Generator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy
from sqlalchemy.engine import make_url
from tenacity import wait_fixed

from outbox import (
    Delivery,
    Endpoint,
    FakeClock,
    Operation,
    OperationConflict,
    OperationNotFound,
    Outbox,
    Reason,
    RetryPolicy,
    State,
    ValidationError,
    create_engine,
)
from outbox.store.migrate import upgrade
from outbox.testing.dialects import DIALECTS, Dialect, endpoint_options
from outbox.testing.receiver import EffectHandler, Receiver, Refuse
from tests.conftest import POSTGRES_URL

BODY = {"sku": "TEST-BOLT", "quantity": 2}

MakeReceiver = Callable[..., Receiver]
MakeOutbox = Callable[..., Outbox]


# --------------------------------------------------------------------------- helpers


@pytest.fixture(params=sorted(DIALECTS))
def dialect(request: pytest.FixtureRequest) -> Dialect:
    """The wording of the receivers' idempotency answers."""
    return DIALECTS[request.param]


@pytest.fixture
def receivers(tmp_path: Path, dialect: Dialect) -> Iterator[MakeReceiver]:
    """Start receivers, each on its own SQLite file; all closed after the test."""
    made: list[Receiver] = []

    def make(name: str = "rx", *, handler: EffectHandler | None = None) -> Receiver:
        rx = Receiver(
            tmp_path / f"receiver-{name}.sqlite3", handler=handler, dialect=dialect.name
        )
        made.append(rx)
        return rx.start()

    yield make
    for rx in made:
        rx.close()


@pytest.fixture
def new_db(db_url: str, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """Another empty, migrated database of the same kind as ``db_url``: broken variants
    run on their own, so the correct run's operations cannot leak into them."""
    schemas: list[str] = []
    admin = None

    def make() -> str:
        nonlocal admin
        if db_url.startswith("sqlite"):
            return f"sqlite:///{tmp_path / f'outbox-{uuid.uuid4().hex[:8]}.sqlite3'}"
        schema = f"t_{uuid.uuid4().hex[:12]}"
        admin = admin or sqlalchemy.create_engine(POSTGRES_URL)
        with admin.begin() as conn:
            conn.execute(sqlalchemy.text(f'CREATE SCHEMA "{schema}"'))
        schemas.append(schema)
        url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
        engine = create_engine(url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
        return url.render_as_string(hide_password=False)

    yield make
    if admin is not None:
        with admin.begin() as conn:
            for schema in schemas:
                conn.execute(sqlalchemy.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def outboxes(db_url: str, dialect: Dialect) -> Iterator[MakeOutbox]:
    """Outboxes on the test's database (SQLite or PostgreSQL), with a fixed backoff of
    one second and a FakeClock; all closed after the test."""
    made: list[Outbox] = []

    def make(
        receiver: Receiver,
        *,
        db: str | None = None,
        auth: httpx.Auth | None = None,
        tenant_header: str | None = "X-Tenant",
        outbox_class: type[Outbox] = Outbox,
        window: timedelta = timedelta(seconds=60),
    ) -> Outbox:
        endpoint = Endpoint(
            name="rx",
            base_url=receiver.url,
            timeout=2.0,
            retry=RetryPolicy(max_attempts=6, window=window, wait=wait_fixed(1)),
            key_retention=timedelta(hours=1),
            tenant_header=tenant_header,
            auth=auth,
            **endpoint_options(dialect.name),
        )
        ob = outbox_class(db or db_url, endpoints=[endpoint], clock=FakeClock())
        made.append(ob)
        return ob

    yield make
    for ob in made:
        ob.close()


def advance(ob: Outbox, seconds: float) -> None:
    assert isinstance(ob.clock, FakeClock)
    ob.clock.advance(seconds)


def settle(ob: Outbox, *operation_ids: str, tenant: str = "", rounds: int = 30) -> list[Operation]:
    """Dispatch, advancing the fake clock past the backoff, until all are settled."""
    for _ in range(rounds):
        ob.dispatch_once()
        ops = [ob.get(op_id, tenant=tenant) for op_id in operation_ids]
        if all(op.is_settled for op in ops):
            return ops
        advance(ob, 1.5)
    raise AssertionError(f"not settled after {rounds} rounds: {operation_ids}")


def reserve(ob: Outbox, operation_id: str, body: Any = None, *, tenant: str = "") -> str:
    op = ob.enqueue(
        endpoint="rx",
        method="POST",
        path="/reservations",
        json=BODY if body is None else body,
        operation_id=operation_id,
        tenant=tenant,
    )
    return op.operation_id


class KeyPerAttempt(httpx.Auth):
    """Deliberately broken: each attempt's request ID also becomes its Idempotency-Key,
    the mistake of a client that mints the operation's identity inside the retry loop."""

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Idempotency-Key"] = request.headers["X-Request-ID"]
        yield request


def naive_reserve(url: str, body: Any, *, tries: int = 2) -> httpx.Response:
    """Deliberately broken, as a hand-written client would be: a fresh UUID per
    transmission, used as both the request ID and the idempotency key."""
    for number in range(tries):
        request_id = str(uuid.uuid4())
        headers = {"Idempotency-Key": request_id, "X-Request-ID": request_id}
        try:
            return httpx.post(f"{url}/reservations", json=body, headers=headers, timeout=2.0)
        except httpx.TransportError:
            if number == tries - 1:
                raise
    raise AssertionError("unreachable")


def effect_ids(*ops: Operation) -> list[int]:
    ids = []
    for op in ops:
        assert op.result is not None
        ids.append(op.result.body["effect_id"])
    return ids


# =========================================================================== article 2:
# operation ID vs request ID, lost response after commit, effects counted at the store.


def test_lost_response_after_commit_two_request_ids_one_operation_one_effect(
    receivers: MakeReceiver, outboxes: MakeOutbox, new_db: Callable[[], str]
) -> None:
    def scenario(ob: Outbox, rx: Receiver) -> Operation:
        rx.faults.drop_after_commit(times=1)
        reserve(ob, "order-17-reserve")
        ob.dispatch_once()
        lost = ob.get("order-17-reserve")
        assert lost.state is State.PENDING  # the caller cannot know: retry, same intent
        assert [a.delivery for a in lost.attempts] == [Delivery.UNKNOWN]
        assert rx.effect_count() == 1  # ... but the receiver did commit
        [op] = settle(ob, "order-17-reserve")
        return op

    rx = receivers("correct")
    op = scenario(outboxes(rx), rx)
    assert op.state is State.SUCCEEDED
    seen = rx.requests()
    assert [r.request_id for r in seen] == [a.request_id for a in op.attempts]
    assert len({r.request_id for r in seen}) == 2  # two request IDs
    assert {r.key for r in seen} == {"order-17-reserve"}  # one operation ID
    assert [r.outcome for r in seen] == ["fault:drop_after_commit", "replayed"]
    assert rx.effect_count() == 1  # one effect
    [effect] = rx.effects()
    assert effect.request_id == op.attempts[0].request_id  # applied by the lost attempt
    assert op.result is not None
    assert op.result.headers["x-request-id"] == op.attempts[1].request_id  # echoed, current
    assert op.result.headers["idempotent-replayed"] == "true"
    assert op.result.body["effect_id"] == effect.id  # the stored business result

    # Broken: the operation's identity minted per attempt. Every response looks fine,
    # the outbox records success: only the store shows the second reservation.
    rx = receivers("key-per-attempt")
    op = scenario(outboxes(rx, auth=KeyPerAttempt(), db=new_db()), rx)
    assert op.state is State.SUCCEEDED
    assert rx.effect_count() == 2
    assert len({e.key for e in rx.effects()}) == 2

    # Broken, by hand, as in the article: a raw httpx loop with a UUID per transmission.
    rx = receivers("naive")
    rx.faults.drop_after_commit(times=1)
    response = naive_reserve(rx.url, BODY)
    assert response.status_code == 201
    assert "idempotent-replayed" not in response.headers
    assert rx.effect_count() == 2


def test_payload_conflict_under_one_key_keeps_the_first_result(
    receivers: MakeReceiver, outboxes: MakeOutbox, new_db: Callable[[], str], dialect: Dialect
) -> None:
    changed = {"sku": "TEST-BOLT", "quantity": 3}

    def scenario(ob: Outbox, rx: Receiver) -> Operation:
        [first] = settle(ob, reserve(ob, "order-17"))
        assert first.state is State.SUCCEEDED
        # The outbox itself refuses another intent under a stored ID, writing nothing.
        with pytest.raises(OperationConflict):
            reserve(ob, "order-17", changed)
        assert ob.get("order-17") == first
        # Once the local record is purged only the receiver remembers the key: reusing
        # it for a changed intent must reach the receiver's payload binding.
        advance(ob, 2 * 24 * 3600)
        ob.reconcile.purge(older_than=timedelta(days=1))
        with pytest.raises(OperationNotFound):
            ob.get("order-17")
        [second] = settle(ob, reserve(ob, "order-17", changed))
        return second

    rx = receivers("correct")
    second = scenario(outboxes(rx), rx)
    assert (second.state, second.reason) == (State.UNRESOLVED, Reason.KEY_CONFLICT)
    assert [a.status_code for a in second.attempts] == [dialect.conflict_status]
    assert rx.effect_count() == 1
    [effect] = rx.effects()
    assert json.loads(effect.body) == BODY
    [receipt] = rx.receipts(key="order-17")
    first_result = json.loads(receipt.response_body or "null")
    assert first_result["received"] == BODY  # the first result is kept
    # A valid replay of the first payload, its object keys in another order, still gets
    # the first result, under the current attempt's request ID.
    response = httpx.post(
        f"{rx.url}/reservations",
        content=b'{"quantity": 2, "sku": "TEST-BOLT"}',
        headers={"Idempotency-Key": "order-17", "X-Request-ID": "attempt-3",
                 "Content-Type": "application/json"},
    )  # fmt: skip
    assert (response.status_code, response.json()) == (dialect.replay_status or 201, first_result)
    assert response.headers["X-Request-ID"] == "attempt-3"
    assert rx.effect_count() == 1

    # Broken: with the key minted per attempt the receiver cannot see the reuse; the
    # changed intent silently becomes a second reservation.
    rx = receivers("key-per-attempt")
    second = scenario(outboxes(rx, auth=KeyPerAttempt(), db=new_db()), rx)
    assert second.state is State.SUCCEEDED
    assert [json.loads(e.body)["quantity"] for e in rx.effects()] == [2, 3]


def test_tenants_scope_operation_ids(
    receivers: MakeReceiver,
    outboxes: MakeOutbox,
    new_db: Callable[[], str],
    dialect: Dialect,
) -> None:
    def scenario(ob: Outbox) -> list[Operation]:
        reserve(ob, "op-1", tenant="test-A")
        reserve(ob, "op-1", tenant="test-B")
        [a] = settle(ob, "op-1", tenant="test-A")
        [b] = settle(ob, "op-1", tenant="test-B")
        return [a, b]

    # The receiver scopes keys by the tenant header.
    rx = receivers("correct")
    a, b = scenario(outboxes(rx))
    assert a.state is b.state is State.SUCCEEDED
    assert sorted(e.tenant for e in rx.effects(key="op-1")) == ["test-A", "test-B"]
    assert len(rx.requests()) == 2  # one request per tenant, two effects
    first, second = effect_ids(a, b)
    assert first != second

    # The tenant in the key: two keys, two effects, at a receiver that knows no tenants.
    rx = receivers("key-prefix")
    prefixed = Endpoint(
        name="rx", base_url=rx.url, timeout=2.0, tenant_scope="key_prefix",
        retry=RetryPolicy(max_attempts=6, window=timedelta(seconds=60), wait=wait_fixed(1)),
        key_retention=timedelta(hours=1), **endpoint_options(dialect.name),
    )  # fmt: skip
    with Outbox(new_db(), endpoints=[prefixed], clock=FakeClock()) as ob:
        a, b = scenario(ob)
    assert a.state is b.state is State.SUCCEEDED
    assert sorted(e.key for e in rx.effects()) == ["test-A/op-1", "test-B/op-1"]
    assert {e.tenant for e in rx.effects()} == {""}
    assert len(rx.requests()) == 2

    # No scope declared: refused at enqueue, nothing written, nothing sent.
    rx = receivers("no-tenant")
    db = new_db()
    ob = outboxes(rx, tenant_header=None, db=db)
    with pytest.raises(ValidationError, match=r"declares no tenant scope.*tenant_header"):
        reserve(ob, "op-1", tenant="test-A")
    engine = sqlalchemy.create_engine(db)
    with engine.connect() as conn:
        assert conn.execute(sqlalchemy.text("SELECT count(*) FROM outbox_operations")).scalar() == 0
    engine.dispose()
    ob.dispatch_once()
    assert rx.requests() == []

    # Broken: per-tenant credentials declared, but every tenant gets the same ones. Both
    # "succeed"; tenant B's reservation was silently suppressed, and only the store shows it.
    rx = receivers("shared-credentials")
    liar = Endpoint(
        name="rx", base_url=rx.url, timeout=2.0, tenant_scope="credentials",
        tenant_auth=lambda tenant: {"X-Api-Key": "one-key-for-everyone"},
        retry=RetryPolicy(max_attempts=6, window=timedelta(seconds=60), wait=wait_fixed(1)),
        key_retention=timedelta(hours=1), **endpoint_options(dialect.name),
    )  # fmt: skip
    with Outbox(new_db(), endpoints=[liar], clock=FakeClock()) as ob:
        a, b = scenario(ob)
    assert a.state is b.state is State.SUCCEEDED
    assert rx.effect_count() == 1
    assert effect_ids(a, b)[0] == effect_ids(a, b)[1]


def test_two_operations_with_equal_payloads_are_two_effects(
    receivers: MakeReceiver, outboxes: MakeOutbox, new_db: Callable[[], str]
) -> None:
    class PayloadHashIds(Outbox):
        """Deliberately broken: derives the operation ID from a hash of the payload."""

        def enqueue(self, **kwargs: Any) -> Operation:
            digest = hashlib.sha256(json.dumps(kwargs["json"], sort_keys=True).encode())
            kwargs["operation_id"] = "h-" + digest.hexdigest()[:32]
            return super().enqueue(**kwargs)

    def scenario(ob: Outbox) -> list[Operation]:
        ids = [reserve(ob, f"order-{n}") for n in (1, 2)]  # two orders, same SKU and quantity
        return settle(ob, *ids)

    rx = receivers("correct")
    ops = scenario(outboxes(rx))
    assert [op.state for op in ops] == [State.SUCCEEDED] * 2
    assert rx.effect_count() == 2
    assert len(set(effect_ids(*ops))) == 2

    rx = receivers("payload-hash")
    ops = scenario(outboxes(rx, outbox_class=PayloadHashIds, db=new_db()))
    assert [op.state for op in ops] == [State.SUCCEEDED] * 2
    assert rx.effect_count() == 1  # the second order was never placed


def test_receipts_survive_a_receiver_restart(
    receivers: MakeReceiver, outboxes: MakeOutbox, new_db: Callable[[], str]
) -> None:
    def scenario(rx: Receiver, *, forget_receipts: bool, db: str | None = None) -> Operation:
        ob = outboxes(rx, db=db)
        rx.faults.drop_after_commit(times=1)
        reserve(ob, "order-9")
        ob.dispatch_once()
        assert ob.get("order-9").state is State.PENDING
        # Both sides restart: the receiver on the same file, the caller on its database.
        rx.stop()
        ob.close()
        if forget_receipts:  # broken: receipts kept like an in-memory cache
            with contextlib.closing(sqlite3.connect(rx.db_path)) as conn, conn:
                conn.execute("DELETE FROM receipts")
        rx.start()
        [op] = settle(outboxes(rx, db=db), "order-9")
        return op

    rx = receivers("correct")
    op = scenario(rx, forget_receipts=False)
    assert op.state is State.SUCCEEDED
    assert rx.effect_count() == 1
    assert [r.outcome for r in rx.requests()] == ["fault:drop_after_commit", "replayed"]
    assert effect_ids(op) == [rx.effects()[0].id]
    assert op.result is not None
    assert op.result.headers["x-request-id"] == op.attempts[-1].request_id

    rx = receivers("forgetful")
    op = scenario(rx, forget_receipts=True, db=new_db())
    assert op.state is State.SUCCEEDED
    assert rx.effect_count() == 2


def test_two_concurrent_identical_operations_give_one_effect(
    receivers: MakeReceiver,
    outboxes: MakeOutbox,
    new_db: Callable[[], str],
    tmp_path: Path,
) -> None:
    def together(*calls: Callable[[], Any]) -> list[Any]:
        """Release the calls at once from their own threads; their results in order."""
        gate = threading.Barrier(len(calls))
        results: list[Any] = [None] * len(calls)
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                gate.wait(timeout=10)
                results[i] = calls[i]()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        return results

    # One outbox database: two callers enqueue the same intent at once, and two
    # dispatchers race for it. One operation, one request, one effect.
    rx = receivers("shared-db")
    first, second = outboxes(rx), outboxes(rx)
    ops = together(lambda: reserve(first, "op-c"), lambda: reserve(second, "op-c"))
    assert ops == ["op-c", "op-c"]
    summaries = together(first.dispatch_once, second.dispatch_once)
    assert sum(s.claimed for s in summaries) == 1
    assert first.get("op-c").state is State.SUCCEEDED
    assert len(rx.requests()) == 1
    assert rx.effect_count() == 1

    # Two callers holding the same operation in two databases send it at once: the
    # receiver's atomic admission gives both the same result and applies it once.
    def scenario(
        rx: Receiver, auth: httpx.Auth | None, name: str, db: str | None = None
    ) -> list[Operation]:
        a = outboxes(rx, auth=auth, db=db)
        b = outboxes(rx, auth=auth, db=f"sqlite:///{tmp_path / f'{name}.sqlite3'}")
        reserve(a, "op-c2")
        reserve(b, "op-c2")
        return together(lambda: settle(a, "op-c2")[0], lambda: settle(b, "op-c2")[0])

    rx = receivers("two-callers")
    a, b = scenario(rx, None, "two-callers")
    assert a.state is b.state is State.SUCCEEDED
    assert rx.effect_count() == 1
    assert a.result is not None and b.result is not None
    assert a.result.body == b.result.body
    assert a.result.headers["x-request-id"] == a.attempts[-1].request_id
    assert b.result.headers["x-request-id"] == b.attempts[-1].request_id
    assert a.attempts[-1].request_id != b.attempts[-1].request_id
    assert sorted(r.outcome for r in rx.requests() if r.outcome != "in_progress") == [
        "applied",
        "replayed",
    ]

    rx = receivers("two-callers-broken")
    a, b = scenario(rx, KeyPerAttempt(), "two-callers-broken", new_db())
    assert a.state is b.state is State.SUCCEEDED
    assert rx.effect_count() == 2


# =========================================================================== article 1:
# a versioned settings row: expected version plus an operation ID, replay of history.

_AUTOMATION = re.compile(r"/automations/(\d+)/interval")
SETTINGS_SCHEMA = """
CREATE TABLE automations (
    id INTEGER PRIMARY KEY, interval_minutes INTEGER NOT NULL, version INTEGER NOT NULL);
INSERT INTO automations VALUES (1, 15, 1);
"""


def set_interval(conn: sqlite3.Connection, path: str, body: Any) -> tuple[int, Any]:
    """The versioned write: change the interval only if the expected version is current."""
    match = _AUTOMATION.fullmatch(path)
    if match is None:
        raise Refuse(404, {"error": "not_found"})
    if not isinstance(body, dict) or set(body) != {"expected_version", "interval_minutes"}:
        raise Refuse(400, {"error": "invalid_body"})
    row = conn.execute(
        "UPDATE automations SET interval_minutes = ?, version = version + 1"
        " WHERE id = ? AND version = ? RETURNING id, interval_minutes, version",
        (body["interval_minutes"], int(match[1]), body["expected_version"]),
    ).fetchone()
    if row is None:
        current = conn.execute(
            "SELECT version FROM automations WHERE id = ?", (int(match[1]),)
        ).fetchone()
        if current is None:
            raise Refuse(404, {"error": "not_found"})
        raise Refuse(412, {"error": "version_conflict", "current_version": current[0]})
    return 200, {"id": row[0], "interval_minutes": row[1], "version": row[2]}


def settings_handler(
    conn: sqlite3.Connection, tenant: str, method: str, path: str, body: Any
) -> tuple[int, Any]:
    """Runs inside the receiver's receipt transaction: row change and receipt commit
    together or not at all."""
    if method != "PUT":
        raise Refuse(405, {"error": "method_not_allowed"})
    return set_interval(conn, path, body)


def seed(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.executescript(SETTINGS_SCHEMA)


def settings_receiver(
    receivers: MakeReceiver, name: str, handler: EffectHandler = settings_handler
) -> Receiver:
    rx = receivers(name, handler=handler)
    seed(rx.db_path)
    return rx


def row(path: Path) -> tuple[int, int]:
    """(interval_minutes, version) of automation 1, read from the store itself."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        found = conn.execute("SELECT interval_minutes, version FROM automations WHERE id = 1")
        interval, version = found.fetchone()
        return int(interval), int(version)


def edit(ob: Outbox, operation_id: str, expected_version: int, minutes: int) -> str:
    op = ob.enqueue(
        endpoint="rx",
        method="PUT",
        path="/automations/1/interval",
        json={"expected_version": expected_version, "interval_minutes": minutes},
        operation_id=operation_id,
    )
    return op.operation_id


def test_replay_after_a_later_edit_returns_history_and_keeps_the_newer_value(
    receivers: MakeReceiver, outboxes: MakeOutbox, new_db: Callable[[], str]
) -> None:
    def scenario(ob: Outbox, rx: Receiver) -> Operation:
        rx.faults.drop_after_commit(times=1)  # edit-42's first attempt
        edit(ob, "edit-42", expected_version=1, minutes=30)
        ob.dispatch_once()  # committed: interval 30, version 2; the response is lost
        assert ob.get("edit-42").state is State.PENDING
        assert row(rx.db_path) == (30, 2)
        # Someone reads version 2 and edits again before edit-42's retry is due.
        edit(ob, "edit-43", expected_version=2, minutes=60)
        ob.dispatch_once()
        assert ob.get("edit-43").state is State.SUCCEEDED
        [op] = settle(ob, "edit-42")
        return op

    rx = settings_receiver(receivers, "correct")
    op = scenario(outboxes(rx), rx)
    assert op.state is State.SUCCEEDED
    assert op.result is not None
    # Historical evidence of edit-42, not a fresh snapshot of the row ...
    assert op.result.body == {"id": 1, "interval_minutes": 30, "version": 2}
    assert op.result.headers["idempotent-replayed"] == "true"
    assert op.result.headers["x-request-id"] == op.attempts[-1].request_id
    # ... and the newer value stays in place.
    assert row(rx.db_path) == (60, 3)
    assert rx.effect_count() == 2

    # Broken: a new key per attempt. The version check refuses edit-42's own retry. The
    # outbox does not call that a failure (a refusal after an attempt that may have been
    # applied proves nothing) but it cannot settle it either: the store shows it applied.
    rx = settings_receiver(receivers, "key-per-attempt")
    op = scenario(outboxes(rx, auth=KeyPerAttempt(), db=new_db()), rx)
    assert (op.state, op.reason) == (State.UNRESOLVED, Reason.CONFLICTING_EVIDENCE)
    assert op.result is not None and op.result.status_code == 412
    applied_by = {e.request_id for e in rx.effects()}
    assert op.attempts[0].request_id in applied_by  # the oracle: edit-42 did apply
    assert row(rx.db_path) == (60, 3)


def test_a_new_key_with_a_stale_version_is_refused(
    receivers: MakeReceiver, outboxes: MakeOutbox, new_db: Callable[[], str]
) -> None:
    def scenario(ob: Outbox, *, rebase: bool) -> Operation:
        settle(ob, edit(ob, "edit-42", expected_version=1, minutes=30))
        # A second intent decided against version 1, which is no longer current.
        [op] = settle(ob, edit(ob, "edit-44", expected_version=1, minutes=45))
        if rebase and op.result is not None and op.result.status_code == 412:
            # Broken: "fix" the refusal by re-sending at the current version under a new
            # key, without the user ever seeing version 2.
            current = op.result.body["current_version"]
            [op] = settle(ob, edit(ob, "edit-44-rebased", expected_version=current, minutes=45))
        return op

    rx = settings_receiver(receivers, "correct")
    op = scenario(outboxes(rx), rebase=False)
    assert op.state is State.FAILED
    assert op.result is not None
    assert op.result.status_code == 412
    assert op.result.body == {"error": "version_conflict", "current_version": 2}
    assert row(rx.db_path) == (30, 2)
    assert rx.effect_count(key="edit-44") == 0
    assert rx.receipts(key="edit-44") == []

    rx = settings_receiver(receivers, "rebasing")
    op = scenario(outboxes(rx, db=new_db()), rebase=True)
    assert op.state is State.SUCCEEDED
    assert row(rx.db_path) == (45, 3)  # the oracle: a stale decision overwrote edit-42


RECEIPT_FAILS = """
CREATE TRIGGER receipt_store_down BEFORE UPDATE OF state ON receipts
WHEN NEW.state = 'complete' BEGIN SELECT RAISE(ABORT, 'receipt store unavailable'); END;
"""


def _break_receipts(rx: Receiver) -> None:
    with contextlib.closing(sqlite3.connect(rx.db_path)) as conn:
        conn.executescript(RECEIPT_FAILS)


def _repair_receipts(rx: Receiver) -> None:
    with contextlib.closing(sqlite3.connect(rx.db_path)) as conn:
        conn.executescript("DROP TRIGGER receipt_store_down;")


def test_a_rolled_back_receipt_write_leaves_no_change(
    receivers: MakeReceiver,
    outboxes: MakeOutbox,
    new_db: Callable[[], str],
    tmp_path: Path,
) -> None:
    def scenario(rx: Receiver, settings_db: Path, db: str | None = None) -> Operation:
        ob = outboxes(rx, db=db)
        _break_receipts(rx)
        edit(ob, "edit-42", expected_version=1, minutes=30)
        ob.dispatch_once()  # the row update ran, then the receipt write failed
        op = ob.get("edit-42")
        assert op.state is State.PENDING
        assert [a.status_code for a in op.attempts] == [500]
        assert rx.effect_count() == 0
        assert [r.state for r in rx.receipts()] in ([], ["processing"])
        observed_before_retry.append(row(settings_db))
        _repair_receipts(rx)
        # Restarting clears any receipt left "processing".
        rx.stop()
        rx.start()
        [op] = settle(ob, "edit-42")
        return op

    observed_before_retry: list[tuple[int, int]] = []
    rx = settings_receiver(receivers, "correct")
    op = scenario(rx, rx.db_path)
    assert observed_before_retry == [(15, 1)]  # rolled back with the receipt: no change
    assert op.state is State.SUCCEEDED
    assert row(rx.db_path) == (30, 2)
    assert rx.effect_count() == 1

    # Broken: the handler commits the settings change on a connection of its own,
    # outside the receipt transaction, so it survives the failed receipt write.
    separate = tmp_path / "settings-elsewhere.sqlite3"
    seed(separate)

    def outside_handler(
        conn: sqlite3.Connection, tenant: str, method: str, path: str, body: Any
    ) -> tuple[int, Any]:
        with contextlib.closing(sqlite3.connect(separate, isolation_level=None)) as own:
            return set_interval(own, path, body)

    observed_before_retry.clear()
    rx = settings_receiver(receivers, "outside", handler=outside_handler)
    op = scenario(rx, separate, new_db())
    assert observed_before_retry == [(30, 2)]  # the oracle: a change without a receipt
    # ... and the version check then refuses the operation's own retry. After a 500 that
    # may have been applied, the outbox does not call that refusal a failure.
    assert (op.state, op.reason) == (State.UNRESOLVED, Reason.CONFLICTING_EVIDENCE)
    assert op.result is not None and op.result.status_code == 412


def test_after_a_rolled_back_receipt_write_the_key_applies_without_a_restart(
    receivers: MakeReceiver, outboxes: MakeOutbox, new_db: Callable[[], str]
) -> None:
    rx = settings_receiver(receivers, "no-restart")
    ob = outboxes(rx, window=timedelta(seconds=10))
    _break_receipts(rx)
    edit(ob, "edit-42", expected_version=1, minutes=30)
    ob.dispatch_once()
    assert row(rx.db_path) == (15, 1)
    _repair_receipts(rx)
    [op] = settle(ob, "edit-42")
    assert rx.receipts(key="edit-42")[0].state == "complete"
    assert op.state is State.SUCCEEDED
    assert row(rx.db_path) == (30, 2)
