"""The transport chosen by measurement (httpx's API over aiohttp, via httpx-aiohttp) keeps
delivery classification safe, against the real receiver over 127.0.0.1.

httpx-aiohttp maps aiohttp's exceptions onto httpx's lossily: "could not connect" and
"server disconnected after the request was sent" both become one httpx class. The
outbox classifies on the exception's cause chain instead, so:

* connection refused                      -> Delivery.NOT_SENT (safe to resend),
* server drops the socket after commit     -> Delivery.UNKNOWN (may have been applied),
* server hangs past the attempt's deadline -> Delivery.UNKNOWN.

And the transport must not resend on its own: aiohttp silently resends PUT and DELETE
once when a connection drops; the session the outbox uses switches that off, so every
request the receiver sees is a recorded attempt with its own request ID.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from tenacity import wait_fixed

pytest.importorskip("aiohttp")

from outbox import Delivery, Endpoint, FakeClock, Outbox, RetryPolicy, State
from outbox.testing.receiver import Receiver
from outbox.wire import transport as outbox_transport
from outbox.wire.transport import AttemptResult, build_client, send_attempt

Factory = Callable[[Endpoint], httpx.AsyncBaseTransport]


def _candidates() -> dict[str, Factory]:
    """The aiohttp-based transport the outbox ships, or the one the benchmarks recommend."""
    found: dict[str, Factory] = {}
    shipped = getattr(outbox_transport, "aiohttp_transport", None)
    if callable(shipped):
        found["shipped"] = shipped
    from benchmarks.transports import aiohttp_outbox, aiohttp_safe, missing

    found["benchmarks.aiohttp_outbox"] = aiohttp_outbox
    if missing("aiohttp_safe") is None:  # httpx-aiohttp installed
        found["benchmarks.aiohttp_safe"] = aiohttp_safe
    return found


CANDIDATES = _candidates()


@pytest.fixture(params=sorted(CANDIDATES))
def factory(request: pytest.FixtureRequest) -> Factory:
    return CANDIDATES[request.param]


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


def _endpoint(url: str, timeout: float = 2.0) -> Endpoint:
    return Endpoint(
        name="rx",
        base_url=url,
        timeout=timeout,
        retry=RetryPolicy(max_attempts=4, window=timedelta(seconds=60), wait=wait_fixed(1)),
        key_retention=timedelta(hours=1),
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends


def _send(
    factory: Factory,
    endpoint: Endpoint,
    *,
    method: str = "POST",
    key: str = "k1",
    request_id: str | None = None,
) -> AttemptResult:
    async def go() -> AttemptResult:
        client = build_client(endpoint, factory(endpoint))
        async with client:
            return await send_attempt(
                client,
                endpoint,
                method=method,
                path="/orders",
                headers={
                    "Idempotency-Key": key,
                    "X-Request-ID": request_id or str(uuid.uuid4()),
                    "content-type": "application/json",
                },
                body=b'{"sku":"TEST-BOLT","quantity":2}',
                now_ms=lambda: 0,
            )

    return asyncio.run(go())


def test_a_success_is_sent_and_succeeds(factory: Factory, receiver: Receiver) -> None:
    result = _send(factory, _endpoint(receiver.url), key="ok-1")
    assert result.status_code == 201
    assert result.classification.delivery is Delivery.SENT
    assert receiver.effect_count(key="ok-1") == 1


def test_connection_refused_is_not_sent(factory: Factory) -> None:
    result = _send(factory, _endpoint(f"http://127.0.0.1:{_closed_port()}"))
    assert result.status_code is None
    assert result.classification.delivery is Delivery.NOT_SENT


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_drop_after_commit_is_unknown_and_never_resent_by_the_transport(
    factory: Factory, receiver: Receiver, method: str
) -> None:
    key = f"drop-{method.lower()}"
    receiver.faults.drop_after_commit(times=1, key=key)
    rid = str(uuid.uuid4())
    result = _send(factory, _endpoint(receiver.url), method=method, key=key, request_id=rid)
    assert result.status_code is None
    assert result.classification.delivery is Delivery.UNKNOWN
    assert receiver.effect_count(key=key) == 1
    # One attempt, one request on the wire: no silent resend under the same request ID.
    seen = receiver.requests(key=key)
    assert [r.request_id for r in seen] == [rid]


def test_hang_past_the_deadline_is_unknown(factory: Factory, receiver: Receiver) -> None:
    receiver.faults.hang_after_commit(key="hang-1")
    result = _send(factory, _endpoint(receiver.url, timeout=0.5), key="hang-1")
    assert result.classification.delivery is Delivery.UNKNOWN
    assert result.error_class == "AttemptDeadlineExceeded"
    assert 400 <= result.duration_ms < 2000
    assert receiver.effect_count(key="hang-1") == 1


def test_stock_httpx_aiohttp_session_would_resend_a_put(receiver: Receiver) -> None:
    """Why the outbox builds its own aiohttp session: the stock one resends a PUT whose
    connection dropped, under the same request ID, without a new attempt in the log."""
    pytest.importorskip("httpx_aiohttp")
    from httpx_aiohttp import AiohttpTransport

    receiver.faults.drop_after_commit(times=1, key="stock-put")
    result = _send(
        lambda ep: AiohttpTransport(), _endpoint(receiver.url), method="PUT", key="stock-put"
    )
    seen = receiver.requests(key="stock-put")
    assert len(seen) == 2  # the second one is the silent resend
    assert seen[0].request_id == seen[1].request_id
    # ...and the caller only sees the replayed 2xx: "sent", one attempt, two deliveries.
    assert result.status_code == 201
    assert result.classification.delivery is Delivery.SENT


def test_dispatcher_over_the_transport_records_unknown_then_replays(
    factory: Factory, receiver: Receiver, tmp_path: Path
) -> None:
    clock = FakeClock()
    ob = Outbox(
        f"sqlite:///{tmp_path / 'outbox.sqlite3'}",
        endpoints=[_endpoint(receiver.url)],
        clock=clock,
        transport_factory=factory,
    )
    try:
        receiver.faults.drop_after_commit(times=1, key="order-1")
        ob.enqueue(
            endpoint="rx", method="PUT", path="/orders/1", json={"sku": "X"}, operation_id="order-1"
        )
        ob.dispatch_once()
        op = ob.get("order-1")
        assert op.state is State.PENDING
        assert [a.delivery for a in op.attempts] == [Delivery.UNKNOWN]
        clock.advance(2)
        ob.dispatch_once()
        op = ob.get("order-1")
        assert op.state is State.SUCCEEDED
        assert [r.request_id for r in receiver.requests(key="order-1")] == [
            a.request_id for a in op.attempts
        ]
        assert receiver.effect_count(key="order-1") == 1
    finally:
        ob.close()


def test_dispatcher_over_the_transport_refused_is_not_sent(
    factory: Factory, tmp_path: Path
) -> None:
    ob = Outbox(
        f"sqlite:///{tmp_path / 'outbox.sqlite3'}",
        endpoints=[_endpoint(f"http://127.0.0.1:{_closed_port()}")],
        clock=FakeClock(),
        transport_factory=factory,
    )
    try:
        ob.enqueue(
            endpoint="rx", method="POST", path="/orders", json={"n": 1}, operation_id="nowhere"
        )
        ob.dispatch_once()
        assert [a.delivery for a in ob.get("nowhere").attempts] == [Delivery.NOT_SENT]
    finally:
        ob.close()


EXACT = {k: v for k, v in CANDIDATES.items() if k != "benchmarks.aiohttp_safe"}


@pytest.fixture(params=sorted(EXACT))
def exact(request: pytest.FixtureRequest) -> Factory:
    return EXACT[request.param]


def test_error_classes_match_httpx_own_transport(exact: Factory, receiver: Receiver) -> None:
    """The attempt log names errors as httpx's own transport would (httpx-aiohttp calls a
    refused connection and a dropped one both ConnectTimeout)."""
    refused = _send(exact, _endpoint(f"http://127.0.0.1:{_closed_port()}"))
    assert refused.error_class == "ConnectError"
    receiver.faults.drop_after_commit(times=1, key="named")
    dropped = _send(exact, _endpoint(receiver.url), key="named")
    assert dropped.error_class == "RemoteProtocolError"


def test_the_path_goes_on_the_wire_as_httpx_built_it(exact: Factory, receiver: Receiver) -> None:
    """No re-quoting: an escaped quote stays escaped (yarl would turn %27 back into ')."""

    async def go() -> None:
        endpoint = _endpoint(receiver.url)
        async with build_client(endpoint, exact(endpoint)) as client:
            response = await client.post(
                "/items/o'brien;--/x%27",
                content=b"{}",
                headers={"Idempotency-Key": "quoted", "content-type": "application/json"},
            )
            assert response.status_code == 201

    asyncio.run(go())
    [seen] = receiver.requests(key="quoted")
    with httpx.Client() as c:
        expected = c.build_request("POST", receiver.url + "/items/o'brien;--/x%27").url.raw_path
    assert seen.path == expected.decode()
