"""The bytes a receiver gets from an attempt are those httpx's own client sends
(``client.build_request`` + ``client.send``) through the same transport: the
dispatcher's cheaper request building never shows on the wire."""

from __future__ import annotations

import asyncio

import pytest

from outbox import Endpoint
from outbox.wire import _httpx_fast as sending
from outbox.wire.transport import build_client, request_headers

CASES: list[tuple[str, dict[str, str], bytes | None]] = [
    ("POST", {}, b'{"sku":"X"}'),
    ("POST", {"Accept": "application/json", "X-Dup": "a"}, b""),
    ("PUT", {"content-type": "text/plain", "USER-AGENT": "ours/1"}, None),
    ("PATCH", {"Host": "elsewhere.example", "Content-Length": "11"}, b'{"sku":"Y"}'),
    ("DELETE", {"Accept-Encoding": "identity", "connection": "close"}, None),
    ("GET", {"X-Request-ID": "forged", "idempotency-key": "forged"}, None),
]


async def _capture(go: object) -> list[bytes]:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
        seen.append(head + (await reader.readexactly(length) if length else b""))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        await go(port)  # type: ignore[operator]
    return seen


@pytest.mark.parametrize(("method", "stored", "body"), CASES)
def test_attempt_bytes_are_httpx_client_bytes(
    method: str, stored: dict[str, str], body: bytes | None
) -> None:
    async def send(port: int, ours: bool) -> None:
        endpoint = Endpoint(
            name="rx", base_url=f"http://127.0.0.1:{port}/api/", headers={"X-Static": "1"},
            auth=lambda: {"Authorization": "Bearer t"},
        )  # fmt: skip
        headers = request_headers(
            endpoint, stored_headers=stored, operation_id="op-1", request_id="req-1",
            tenant="", has_body=body is not None,
        )  # fmt: skip
        client = build_client(endpoint, None)
        try:
            if ours:
                request = sending.build_request(client, method, "/orders?x=%2F", headers=headers,
                                                content=body)  # fmt: skip
                response = await sending.send(client, request)
            else:
                request = client.build_request(method, "/orders?x=%2F", headers=headers,
                                               content=body)  # fmt: skip
                response = await client.send(request, stream=True)
            await response.aread()
            await response.aclose()
        finally:
            await client.aclose()

    async def both(port: int) -> None:
        await send(port, True)
        await send(port, False)

    seen = asyncio.run(_capture(both))
    assert len(seen) == 2
    assert seen[0] == seen[1]
