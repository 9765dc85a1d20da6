"""Every credential the receiver echoes back stays out of the stored evidence.

The receiver (``tests.faults.hostile`` ``/echo``) answers with a JSON body that repeats
every request header plainly, JSON-escaped (``\\uXXXX`` for every character, ``\\/``),
and as response headers, one of them the ``X-Request-ID`` read as the receiver's own
request ID. The credentials: a header named in ``Outbox(secret_headers=...)`` set as a
static endpoint header, a bearer token from an auth callable, and an ``httpx.Auth`` that
signs each request. Checked in the raw bytes of the SQLite files (main, -wal, -shm) and
in the PostgreSQL rows as text.
"""

from __future__ import annotations

import base64
from collections.abc import Generator, Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from tenacity import wait_fixed

from outbox import Endpoint, Outbox, RetryPolicy, State
from tests.faults.hostile import hostile_receiver

API_KEY = "key/PLANTED+a1b2c3d4e5"
BEARER = "tok/PLANTED.f6e7d8c9b0"
SIGNATURE = "sig/PLANTED=0a9b8c7d6e"


class _Signer(httpx.Auth):
    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["X-Signature"] = SIGNATURE
        yield request


class _NewRequestSigner(httpx.Auth):
    """A signing auth that sends a request of its own making, not the one it was given:
    the signature exists only on the request that went out."""

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        headers = {**request.headers, "X-Signature": SIGNATURE}
        yield httpx.Request(request.method, request.url, headers=headers,
                            content=request.content)  # fmt: skip


def _forms(secret: str) -> list[bytes]:
    escaped_u = "".join(f"\\u{ord(c):04x}" for c in secret)
    return [secret.encode(), secret.replace("/", "\\/").encode(), escaped_u.encode(),
            escaped_u.upper().replace("\\U", "\\u").encode(),
            base64.b64encode(secret.encode())]  # fmt: skip


@pytest.fixture
def echo() -> Iterator[str]:
    with hostile_receiver() as (url, _):
        yield url


@pytest.mark.parametrize("auth_kind", ["callable", "httpx-auth", "httpx-auth-new-request"])
def test_echoed_credentials_are_redacted_in_every_stored_form(
    auth_kind: str, db_url: str, echo: str
) -> None:
    auth: object = {
        "callable": lambda: {"Authorization": f"Bearer {BEARER}"},
        "httpx-auth": _Signer(),
        "httpx-auth-new-request": _NewRequestSigner(),
    }[auth_kind]
    endpoint = Endpoint(
        name="rx", base_url=echo, timeout=5.0, headers={"X-Api-Key": API_KEY},
        retry=RetryPolicy(max_attempts=1, window=timedelta(minutes=5), wait=wait_fixed(1)),
        key_retention=timedelta(hours=1), auth=auth,  # type: ignore[arg-type]
        evidence_headers=("x-request-id", "x-echo-x-api-key", "x-echo-x-signature",
                          "x-echo-authorization", "content-type"),
    )  # fmt: skip
    with Outbox(db_url, endpoints=[endpoint], secret_headers=["X-Api-Key"]) as ob:
        ob.enqueue(endpoint="rx", method="POST", path="/echo", json={"a": 1},
                   operation_id="echoed")  # fmt: skip
        ob.dispatch_once()
        op = ob.get("echoed")
        assert op.state is State.SUCCEEDED and op.result is not None
        body = op.result.body
        # It was sent and echoed (the evidence is there, redacted).
        sent = {k.lower(): v for k, v in body["headers"].items()}
        assert sent.get("x-api-key") == "[REDACTED]"
        assert "[REDACTED]" in body["raw_escaped"]
        assert op.result.headers["x-echo-x-api-key"] == "[REDACTED]"
        if auth_kind == "callable":
            assert sent.get("authorization") == "[REDACTED]"
            (attempt,) = op.attempts
            # The receiver's X-Request-ID echoed the credential: kept, redacted.
            assert attempt.receiver_request_id == "x-request-id: [REDACTED]"
        else:
            assert sent.get("x-signature") == "[REDACTED]"
        # The non-secret evidence survives.
        assert sent.get("idempotency-key") == "echoed"
        stored = _stored_bytes(ob, db_url)
    secrets = [API_KEY, BEARER if auth_kind == "callable" else SIGNATURE]
    for secret in secrets:
        for form in _forms(secret):
            assert form not in stored, (secret, form)


def _stored_bytes(ob: Outbox, db_url: str) -> bytes:
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        db = Path(url.database or "")
        files = [p for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists()]
        assert files
        return b"".join(p.read_bytes() for p in files)
    with ob.engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT o::text FROM outbox_operations o UNION ALL "
            "SELECT a::text FROM outbox_attempts a UNION ALL "
            "SELECT d::text FROM outbox_audit d")).scalars().all()  # fmt: skip
    assert rows
    return "\n".join(rows).encode()
