"""A request that never left is never "maybe applied".

Refused at enqueue, naming the field, with nothing written: a header value the
transport cannot encode ("café": HTTP/1.1 header values go out as ASCII), a lone
surrogate in a body, a header or a path. And a request whose building raises at send
time (an auth callable that raises, or that returns a value the transport cannot
encode) ends every attempt ``not_sent`` with its error class; the receiver (a raw
socket that counts connections) sees nothing; the operation is never
``outcome_unknown``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from sqlalchemy import text
from tenacity import wait_fixed

from outbox import Delivery, Endpoint, Outbox, RetryPolicy, State, ValidationError
from tests.security.test_malformed_echo import reflecting_receiver


def _ok(tok: bytes) -> bytes:
    return b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}"


def _endpoint(url: str, auth: Callable[[], dict[str, str]] | None = None) -> Endpoint:
    return Endpoint(
        name="rx", base_url=url, timeout=5.0, auth=auth,
        retry=RetryPolicy(max_attempts=3, window=timedelta(minutes=5), wait=wait_fixed(0)),
        key_retention=timedelta(hours=1),
    )  # fmt: skip


def _rows(ob: Outbox) -> int:
    with ob.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outbox_operations")).scalar_one())


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"headers": {"X-Note": "café"}}, "X-Note"),
        ({"headers": {"X-Note": "a\ud800b"}}, "X-Note"),
        ({"json": {"a": "x\udc00"}}, "json body"),
        ({"path": "/x/\ud800"}, "path"),
    ],
    ids=["non-ascii-header", "surrogate-header", "surrogate-body", "surrogate-path"],
)
def test_what_can_never_be_sent_is_refused_at_enqueue(
    kwargs: dict[str, object], names: str, db_url: str
) -> None:
    with reflecting_receiver(_ok) as (url, requests), Outbox(
        db_url, endpoints=[_endpoint(url)]
    ) as ob:
        args: dict[str, object] = {"path": "/x", "json": {"a": 1}, **kwargs}
        with pytest.raises(ValidationError, match=names):
            ob.enqueue(endpoint="rx", method="POST", operation_id="never", **args)  # type: ignore[arg-type]
        assert ob.find("never") is None
        assert _rows(ob) == 0
    assert requests == []


def _raises() -> dict[str, str]:
    raise RuntimeError("token service down")


@pytest.mark.parametrize(
    "auth",
    [_raises, lambda: {"X-Token": "café"}, lambda: {"X-Token": "a\ud800"}],
    ids=["auth-raises", "auth-non-ascii", "auth-surrogate"],
)
def test_a_request_that_cannot_be_built_is_not_sent(
    auth: Callable[[], dict[str, str]], db_url: str
) -> None:
    with reflecting_receiver(_ok) as (url, requests), Outbox(
        db_url, endpoints=[_endpoint(url, auth)]
    ) as ob:
        ob.enqueue(endpoint="rx", method="POST", path="/x", json={"a": 1}, operation_id="nb")
        for _ in range(5):
            ob.dispatch_once()
        op = ob.get("nb")
        assert op is not None and op.attempts
        assert all(a.delivery is Delivery.NOT_SENT for a in op.attempts), op.attempts
        assert all(a.error_class for a in op.attempts)
        assert op.state is not State.IN_FLIGHT
        assert "outcome_unknown" not in str(op.reason)
    assert requests == []
