"""outbox.wire.exchange: one request, a bounded read, a deadline, the error named."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from outbox.classify import Classification
from outbox.config import Endpoint
from outbox.model import Delivery, ErrorClass, Verdict
from outbox.wire.exchange import Exchange, exchange
from outbox.wire.transport import build_client

BASE = "https://rx.example/api"


class _Never(httpx.AsyncByteStream):
    """A body that never ends: only the deadline stops reading it."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"{"
        await asyncio.Event().wait()


Handler = Callable[[httpx.Request], httpx.Response]


def _run(handler: Handler, path: str = "/ops", **options: Any) -> Exchange:
    async def go() -> Exchange:
        endpoint = Endpoint(name="rx", base_url=BASE)
        async with build_client(endpoint, httpx.MockTransport(handler)) as client:
            kwargs: dict[str, Any] = {
                "headers": {"X-Request-ID": "r1"},
                "content": b"{}",
                "deadline_seconds": 5.0,
                "keep": 4,
                "limit": 1024,
                **options,
            }
            return await exchange(client, "POST", path, **kwargs)

    return asyncio.run(go())


def test_an_answer_is_read_bounded_and_hashed() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201, headers={"Request-Id": "rx-9"}, content=b"0123456789")

    ex = _run(handler)
    assert ex.error is None and ex.error_class is None and not ex.refused
    assert ex.status == 201 and ex.headers is not None and ex.headers["request-id"] == "rx-9"
    body = ex.body
    assert body is not None
    assert (body.head, body.size, body.complete) == (b"0123", 10, True)
    assert body.sha256 == hashlib.sha256(b"0123456789").hexdigest()
    assert ex.request is sent[0]
    assert str(sent[0].url) == BASE + "/ops" and sent[0].headers["X-Request-ID"] == "r1"


def test_home_only_refuses_a_path_that_leaves_the_base_url_without_sending() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200)

    for path in ("//evil.example/x", "https://evil.example/x", "ops"):
        ex = _run(handler, path, home_only=True)
        assert ex.refused and ex.error_class == ErrorClass.UNSAFE_PATH.value, path
    assert sent == []
    assert not _run(handler, "//evil.example/x").refused


def test_a_connect_failure_is_not_sent_and_named_by_its_class() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    ex = _run(handler)
    assert (ex.status, ex.body, ex.error_class) == (None, None, "ConnectError")
    assert ex.error_classification().delivery is Delivery.NOT_SENT
    assert ex.error_text() == "ConnectError: refused"


def test_a_read_error_may_have_been_applied() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("reset", request=request)

    classification = _run(handler).error_classification()
    assert (classification.delivery, classification.maybe_applied) == (Delivery.UNKNOWN, True)


def test_the_deadline_stops_a_body_that_never_ends_and_the_request_counts_as_sent() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Never())

    ex = _run(handler, deadline_seconds=0.05)
    assert ex.timed_out and ex.status == 200 and ex.body is None
    assert ex.error_class == ErrorClass.ATTEMPT_DEADLINE_EXCEEDED.value
    # Even an endpoint classifier saying "not sent" cannot unsend what got an answer.
    said = Classification(Verdict.RETRY, Delivery.NOT_SENT)
    assert ex.error_classification(said).delivery is Delivery.UNKNOWN


def test_a_classifiers_copy_holds_the_decoded_body_without_framing_headers() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Encoding": "identity"}, content=b"abc")

    ex = _run(handler)
    copy = ex.readable(b"decoded")
    assert copy.content == b"decoded" and "content-encoding" not in copy.headers
    assert copy.status_code == 200
