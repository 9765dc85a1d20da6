"""Classification: only a provable connect failure is "not sent"."""

from __future__ import annotations

import httpx
import pytest

from outbox import Delivery, Verdict
from outbox.wire.transport import classify_exception, classify_response, is_key_mismatch

NOW = 1_800_000_000_000


def _response(status: int, body: bytes = b"", **headers: str) -> httpx.Response:
    return httpx.Response(status, content=body, headers=headers)


@pytest.mark.parametrize(
    ("status", "verdict", "maybe", "refused"),
    [
        (200, Verdict.SUCCESS, True, False),
        (201, Verdict.SUCCESS, True, False),
        (409, Verdict.IN_PROGRESS, True, False),
        (503, Verdict.RETRY, False, True),
        (429, Verdict.RETRY, False, True),
        (408, Verdict.RETRY, False, True),
        (425, Verdict.RETRY, False, True),
        (500, Verdict.RETRY, True, False),
        (502, Verdict.RETRY, True, False),
        (504, Verdict.RETRY, True, False),
        (507, Verdict.RETRY, True, False),
        (400, Verdict.FAILED, False, False),
        (404, Verdict.FAILED, False, False),
        (422, Verdict.FAILED, False, False),
        (302, Verdict.FAILED, False, False),
    ],
)
def test_status_classification(status: int, verdict: Verdict, maybe: bool, refused: bool) -> None:
    c = classify_response(_response(status), b"", NOW)
    assert (c.verdict, c.maybe_applied, c.refused) == (verdict, maybe, refused)
    assert c.delivery is Delivery.SENT


def test_422_marked_as_key_mismatch_is_key_conflict() -> None:
    body = b'{"error": "idempotency_key_reused"}'
    assert classify_response(_response(422, body), body, NOW).verdict is Verdict.KEY_CONFLICT
    assert is_key_mismatch(_response(422), b'{"error": {"code": "IdempotencyMismatch"}}')
    assert not is_key_mismatch(_response(422), b'{"error": "invalid_sku"}')
    assert not is_key_mismatch(_response(422), b"not json")


def test_retry_after_is_read() -> None:
    c = classify_response(_response(503, **{"Retry-After": "4"}), b"", NOW)
    assert c.retry_after_seconds == 4.0


@pytest.mark.parametrize(
    "exc", [httpx.ConnectError("refused"), httpx.ConnectTimeout("slow"), httpx.PoolTimeout("full")]
)
def test_connect_failures_are_not_sent(exc: Exception) -> None:
    assert classify_exception(exc).delivery is Delivery.NOT_SENT


@pytest.mark.parametrize(
    "exc",
    [httpx.ReadTimeout("r"), httpx.WriteTimeout("w"), httpx.ReadError("r"),
     httpx.WriteError("w"), httpx.RemoteProtocolError("closed"), TimeoutError(), OSError("x")],
)
def test_everything_else_is_unknown(exc: Exception) -> None:
    c = classify_exception(exc)
    assert (c.delivery, c.maybe_applied) == (Delivery.UNKNOWN, True)


def test_lossy_transport_mapping_is_seen_through() -> None:
    """httpx-aiohttp maps "server disconnected" to ConnectTimeout: the cause decides."""

    class ServerDisconnectedError(Exception):
        __module__ = "aiohttp.client_exceptions"

    class ClientConnectorError(Exception):
        __module__ = "aiohttp.client_exceptions"

    try:
        try:
            raise ServerDisconnectedError("Server disconnected")
        except ServerDisconnectedError as inner:
            raise httpx.ConnectTimeout("Server disconnected") from inner
    except httpx.ConnectTimeout as mapped:
        assert classify_exception(mapped).delivery is Delivery.UNKNOWN
    try:
        try:
            raise ClientConnectorError("Cannot connect")
        except ClientConnectorError as inner:
            raise httpx.ConnectError("Cannot connect") from inner
    except httpx.ConnectError as mapped:
        assert classify_exception(mapped).delivery is Delivery.NOT_SENT
