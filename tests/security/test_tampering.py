"""A row tampered in the database never aims the dispatcher anywhere but the registered
base URL: the "other host" (a second receiver, and a bare listener that counts every
TCP connection) must get nothing. On SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update
from tenacity import wait_fixed

from outbox import Endpoint, FakeClock, Outbox, RetryPolicy, State
from outbox.store.tables import operations
from outbox.testing.receiver import Receiver
from tests.security.support import ConnectionCounter

SECRET = "PLANTED-tamper-credential-0b1c"


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "home.sqlite3") as rx:
        yield rx


@pytest.fixture
def other(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "other.sqlite3") as rx:
        yield rx


@pytest.fixture
def counter() -> Iterator[ConnectionCounter]:
    with ConnectionCounter() as c:
        yield c


@pytest.fixture
def ob(db_url: str, home: Receiver) -> Iterator[Outbox]:
    outbox = Outbox(
        db_url,
        endpoints=[Endpoint(name="rx", base_url=home.url + "/api", timeout=1.0,
                            retry=RetryPolicy(window=timedelta(minutes=5), wait=wait_fixed(1)),
                            key_retention=timedelta(hours=1),
                            auth=lambda: {"Authorization": f"Bearer {SECRET}"})],
        clock=FakeClock(),
    )  # fmt: skip
    yield outbox
    outbox.close()


def _tamper(ob: Outbox, op_id: str, **values: str) -> None:
    ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"operation_id": op_id},
               operation_id=op_id)  # fmt: skip
    with ob.engine.begin() as conn:
        conn.execute(update(operations).where(operations.c.operation_id == op_id).values(**values))


def test_unknown_endpoint_name_is_not_sent_anywhere(
    ob: Outbox, home: Receiver, other: Receiver
) -> None:
    _tamper(ob, "t-endpoint", endpoint="evil")
    summary = ob.dispatch_once()
    assert summary.attempts == 0
    assert home.requests() == [] and other.requests() == []
    op = ob.get("t-endpoint")
    assert op.state is State.PENDING  # put back, not sent, not lost
    assert op.attempts == ()


@pytest.mark.parametrize(
    "shape",
    [
        "absolute",
        "scheme-relative",
        "backslash",
    ],
)
def test_tampered_path_never_leaves_the_registered_origin(
    shape: str,
    ob: Outbox,
    home: Receiver,
    other: Receiver,
    counter: ConnectionCounter,
) -> None:
    host = other.url.removeprefix("http://")
    paths = {
        "absolute": [f"http://{host}/x", f"http://127.0.0.1:{counter.port}/y"],
        "scheme-relative": [f"//{host}/x", f"//127.0.0.1:{counter.port}/y"],
        "backslash": [f"/\\\\{host}/x", f"\\\\127.0.0.1:{counter.port}/y"],
    }[shape]
    for i, path in enumerate(paths):
        _tamper(ob, f"t-{shape}-{i}", path=path)
    ob.dispatch_once()
    assert other.requests() == []
    assert counter.accepted == 0
    for i in range(len(paths)):
        op = ob.get(f"t-{shape}-{i}")
        # Whatever happened, it happened at home (or nowhere).
        assert all(r.path.startswith("/api/") for r in home.requests(key=op.operation_id))


@pytest.mark.parametrize("stored", ["not json", '["a", "list"]', '{"x": {"nested": 1}'])
def test_corrupt_stored_headers_hold_that_row_and_never_the_batch(
    ob: Outbox, home: Receiver, other: Receiver, stored: str
) -> None:
    """Headers changed outside outbox into something that is not a JSON object: that one
    operation is held back (not sent, reason kept) and the rest of the batch goes out;
    once its window has closed it is unresolved with a not-sent attempt as evidence."""
    _tamper(ob, "t-headers", headers=stored)
    ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"n": 1},
               operation_id="t-fine")  # fmt: skip
    summary = ob.dispatch_once()
    assert summary.claimed == 2 and summary.succeeded == 1
    assert [r.key for r in home.requests()] == ["t-fine"]
    held = ob.get("t-headers")
    assert held.state is State.PENDING and held.attempts == ()
    assert held.last_error is not None and "stored headers" in held.last_error
    assert isinstance(ob.clock, FakeClock)
    ob.clock.advance(timedelta(minutes=6).total_seconds())
    ob.dispatch_once()
    settled = ob.get("t-headers")
    assert settled.state is State.UNRESOLVED
    (attempt,) = settled.attempts
    assert attempt.delivery.value == "not_sent" and attempt.error_class == "OperationUnsendable"
    assert [r.key for r in home.requests()] == ["t-fine"] and other.requests() == []
