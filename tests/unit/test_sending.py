"""The dispatcher's cheaper httpx requests are the requests httpx would build and send."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from outbox import Endpoint
from outbox.wire import _httpx_fast as sending
from outbox.wire.transport import build_client

HEADERS = {
    "content-type": "application/json",
    "Idempotency-Key": "order-17",
    "X-Request-ID": "5b0f2a9e-0000-4000-8000-000000000001",
    "Accept": "application/json",  # replaces the client's default, case-insensitively
}


@pytest.mark.parametrize("base", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/api/v1/"])
@pytest.mark.parametrize(
    "path", ["/orders", "/orders/17?expand=lines&x=%2F", "/caf\u00e9 au lait", "/a//b"]
)
def test_build_request_matches_httpx(base: str, path: str) -> None:
    client = build_client(Endpoint(name="rx", base_url=base), httpx.MockTransport(_ok))
    body = b'{"sku":"X"}'
    for _ in range(2):  # the second time from the remembered URL
        ours = sending.build_request(client, "POST", path, headers=HEADERS, content=body)
        theirs = client.build_request("POST", path, headers=HEADERS, content=body)
        assert ours.method == theirs.method
        assert ours.url == theirs.url
        assert ours.headers.raw == theirs.headers.raw
        assert ours.read() == theirs.read()
        assert ours.extensions == theirs.extensions


def _ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"set-cookie": "session=abc; Path=/"}, json={})


class _Stamp(httpx.Auth):
    def auth_flow(self, request: httpx.Request):  # type: ignore[no-untyped-def]
        request.headers["Authorization"] = "Bearer stamped-by-auth-flow"
        yield request


def _send_twice(client: httpx.AsyncClient, seen: list[httpx.Request]) -> None:
    async def go() -> None:
        for _ in range(2):
            request = sending.build_request(client, "POST", "/x", headers={}, content=b"{}")
            response = await sending.send(client, request)
            await response.aread()
            await response.aclose()
        await client.aclose()

    asyncio.run(go())


def test_send_goes_through_auth_and_hooks_when_the_client_has_them() -> None:
    seen: list[httpx.Request] = []
    hooked: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return _ok(request)

    endpoint = Endpoint(name="rx", base_url="http://127.0.0.1:8000", auth=_Stamp())
    client = build_client(endpoint, httpx.MockTransport(record))

    async def hook(request: httpx.Request) -> None:
        hooked.append(str(request.url))

    client.event_hooks["request"] = [hook]
    _send_twice(client, seen)
    assert [r.headers["authorization"] for r in seen] == ["Bearer stamped-by-auth-flow"] * 2
    assert len(hooked) == 2


def test_no_cookie_is_ever_sent_back() -> None:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return _ok(request)

    for auth in (None, _Stamp()):  # the direct path and client.send alike
        seen.clear()
        endpoint = Endpoint(name="rx", base_url="http://127.0.0.1:8000", auth=auth)
        _send_twice(build_client(endpoint, httpx.MockTransport(record)), seen)
        assert len(seen) == 2
        assert all("cookie" not in r.headers for r in seen)


EDGE_HEADERS: list[dict[str, str]] = [
    {},
    HEADERS,
    {"Host": "elsewhere.example"},  # Host given: none added
    {"content-length": "999"},  # given (wrong or not): kept, none added
    {"Transfer-Encoding": "chunked"},
    {"ACCEPT-ENCODING": "identity", "user-agent": "ours/1", "Connection": "close"},
    {"X-Caf\u00e9": "1"},  # httpx refuses it: so must we, the same way
    {"X-Value": "caf\u00e9"},
]


@pytest.mark.parametrize("base", ["http://127.0.0.1:8000", "http://example.test", "http://[::1]:81/a/"])
@pytest.mark.parametrize("method", ["POST", "put", "PATCH", "GET", "DELETE"])
@pytest.mark.parametrize("content", [None, b"", b'{"sku":"X"}'])
def test_built_request_is_httpx_request(base: str, method: str, content: bytes | None) -> None:
    client = build_client(Endpoint(name="rx", base_url=base), httpx.MockTransport(_ok))
    for headers in EDGE_HEADERS:
        for _ in range(2):  # the second time from the remembered URL
            ours = _built(lambda h=headers: sending.build_request(
                client, method, "/orders?x=1", headers=h, content=content))
            theirs = _built(lambda h=headers: client.build_request(
                method, "/orders?x=1", headers=h, content=content))
            assert ours == theirs, headers


def _built(build: Any) -> Any:
    try:
        request = build()
    except Exception as exc:  # the same error, or none
        return type(exc), str(exc)
    state = dict(vars(request))
    state["url"] = str(request.url)
    state["headers"] = (request.headers.raw, request.headers._encoding)
    state["stream"] = (type(request.stream), b"".join(request.stream))
    return state
