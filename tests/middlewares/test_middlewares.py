"""The outbox against real server-side idempotency middlewares from the package index.

asgi-idempotency-header, fastapi-idempotency-key and fastapi-idempotency (Starlette
apps) and django-idempotency-key (a Django app), each served by uvicorn in its own
process behind a TCP proxy that can lose a response after the receiver answered. The
handler's own SQLite file counts effects. On SQLite and PostgreSQL, FakeClock time.

What each middleware does decides what the outbox can prove:

* a lost response is retried under the same key and replayed: succeeded, one effect
  (django-idempotency-key replays with 409 and the original body: the endpoint declares
  ``replay_status=409``);
* a changed payload under a used key is ``key_conflict`` where the middleware compares
  payloads (fastapi-idempotency-key, fastapi-idempotency: 422 ``{"detail": ...}``);
  asgi-idempotency-header does not compare them (it replays the first result), and
  django-idempotency-key hashes the body into its key (a changed payload is a new key);
* no scenario sends more requests than ``max_attempts`` plus the in-progress budget,
  even against asgi-idempotency-header's key stuck "already pending" after a handler
  exception.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from tenacity import wait_fixed

from outbox import Endpoint, FakeClock, Operation, Outbox, Reason, RetryPolicy, State
from tests.middlewares.apps import FACTORIES
from tests.middlewares.support import Served, serve

pytest.importorskip("uvicorn")

BODY = {"sku": "TEST-BOLT", "quantity": 2}
CHANGED = {"sku": "TEST-BOLT", "quantity": 3}
#: Whether the middleware binds a key to its payload.
COMPARES_PAYLOADS = {"fastapi-idempotency-key", "fastapi-idempotency"}
#: The status a replay comes back with, where it is not the original 2xx.
REPLAY_STATUS = {"django-idempotency-key": 409}
POLICY = RetryPolicy(max_attempts=4, window=timedelta(minutes=30), wait=wait_fixed(1),
                     in_progress_budget=5)  # fmt: skip


@pytest.fixture(params=sorted(FACTORIES))
def middleware(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Served]]:
    name = request.param
    with serve(FACTORIES[name], tmp_path) as served:
        yield name, served


def make_outbox(db_url: str, name: str, served: Served) -> Outbox:
    endpoint = Endpoint(
        name="mw", base_url=served.url, timeout=5.0, retry=POLICY,
        key_retention=timedelta(hours=24), replay_status=REPLAY_STATUS.get(name),
    )  # fmt: skip
    return Outbox(db_url, endpoints=[endpoint], clock=FakeClock())


def send(ob: Outbox, operation_id: str, body: Any, path: str = "/reservations") -> Operation:
    ob.enqueue(endpoint="mw", method="POST", path=path, json=body, operation_id=operation_id)
    assert isinstance(ob.clock, FakeClock)
    for _ in range(POLICY.max_attempts + POLICY.in_progress_budget + 2):
        ob.dispatch_once()
        op = ob.get(operation_id)
        if op.is_settled:
            return op
        assert op.next_attempt_at_ms is not None
        ob.clock.advance(max(0.0, (op.next_attempt_at_ms - ob.clock.now_ms()) / 1000))
    raise AssertionError(f"{operation_id} still {op.state} after the whole budget")


def test_a_lost_response_ends_succeeded_with_one_effect(
    db_url: str, middleware: tuple[str, Served]
) -> None:
    name, served = middleware
    with make_outbox(db_url, name, served) as ob:
        served.proxy.drop_next_response()
        op = send(ob, "order-17", BODY)
    assert op.state is State.SUCCEEDED, (op.state, op.reason, op.attempts)
    assert op.attempts_total == 2
    effects = served.effects()
    assert len(effects) == 1
    assert op.result is not None
    assert op.result.body["effect_id"] == 1  # the first attempt's effect, replayed
    assert json.loads(effects[0][1]) == BODY


def test_a_changed_payload_under_a_used_key(db_url: str, middleware: tuple[str, Served]) -> None:
    name, served = middleware
    with make_outbox(db_url, name, served) as ob:
        first = send(ob, "order-17", BODY)
        assert first.state is State.SUCCEEDED
        # The local record is purged; only the receiver remembers the key.
        assert isinstance(ob.clock, FakeClock)
        ob.clock.advance(2 * 24 * 3600)
        ob.reconcile.purge(older_than=timedelta(days=1))
        second = send(ob, "order-17", CHANGED)
    effects = served.effects()
    if name in COMPARES_PAYLOADS:
        assert (second.state, second.reason) == (State.UNRESOLVED, Reason.KEY_CONFLICT)
        assert [a.status_code for a in second.attempts] == [422]
        assert len(effects) == 1
    elif name == "asgi-idempotency-header":
        # It does not compare payloads: the first result comes back as a replay. The
        # outbox cannot know; the receiver's store shows the changed intent never ran.
        assert second.state is State.SUCCEEDED
        assert second.result is not None and second.result.body["received"] == BODY
        assert len(effects) == 1
    else:
        # django-idempotency-key hashes the body into its key: a new operation to it.
        assert second.state is State.SUCCEEDED
        assert [json.loads(body) for _, body in effects] == [BODY, CHANGED]


def test_no_scenario_loops_beyond_the_budget(db_url: str, middleware: tuple[str, Served]) -> None:
    """A handler that raises after its effect: asgi-idempotency-header keeps the key
    "already pending" forever; the others answer 500 and forget or keep it."""
    name, served = middleware
    with make_outbox(db_url, name, served) as ob:
        op = send(ob, "order-18", BODY, path="/explode")
    assert op.state is State.UNRESOLVED
    assert op.attempts_total <= POLICY.max_attempts + POLICY.in_progress_budget
    assert op.attempts_counted <= POLICY.max_attempts
    if name == "asgi-idempotency-header":
        assert op.reason is Reason.RECEIVER_BUSY
        assert [a.status_code for a in op.attempts] == [500] + [409] * POLICY.in_progress_budget
        assert len(served.effects()) == 1
    else:
        assert op.reason is Reason.OUTCOME_UNKNOWN  # 500s: each may have been applied
