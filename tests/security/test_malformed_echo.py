"""A receiver that reflects the request's credential into a *malformed* response.

aiohttp's parser errors quote the raw bytes they choke on (a header line without a
colon, a bad status line, a bad ``Content-Length``). The receiver here is a raw socket
on 127.0.0.1 that copies the request's ``Authorization`` value into exactly that spot:
the stored attempt error, the audit trail and the status lookup's evidence must carry
``[REDACTED]``, never the token, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from tenacity import wait_fixed

from outbox import ConfigurationError, Endpoint, Outbox, RetryPolicy, StatusLookup
from outbox.model import LookupResult
from outbox.wire.lookup import lookup_status
from outbox.wire.transport import build_client
from tests.security.test_echoed_secrets import _stored_bytes

TOKEN = "tok-PLANTED-9f8e7d6c5b4a"

#: How each malformed response quotes the reflected token.
FORMS: dict[str, Callable[[bytes], bytes]] = {
    "header-without-colon": lambda tok: (
        b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\nBearer " + tok + b"\r\n\r\n"
    ),
    "bad-status-line": lambda tok: b"HTTP/1.1 5x0 " + tok + b"\r\nContent-Length: 0\r\n\r\n",
    "bad-content-length": lambda tok: (
        b"HTTP/1.1 500 Oops\r\nContent-Length: 12" + tok + b"\r\n\r\n"
    ),
}


@contextmanager
def reflecting_receiver(form: Callable[[bytes], bytes]) -> Iterator[tuple[str, list[bytes]]]:
    """A raw-socket HTTP peer answering every request with ``form(<Authorization>)``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    requests: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                requests.append(data)
                found = re.search(rb"(?im)^authorization:\s*bearer\s+(\S+)", data)
                conn.sendall(form(found.group(1) if found else b"none"))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", requests
    finally:
        stop.set()
        listener.close()
        thread.join(timeout=5)


def _endpoint(url: str, **extra: object) -> Endpoint:
    return Endpoint(
        name="rx", base_url=url, timeout=5.0,
        auth=lambda: {"Authorization": f"Bearer {TOKEN}"},
        retry=RetryPolicy(max_attempts=1, window=timedelta(minutes=5), wait=wait_fixed(1)),
        key_retention=timedelta(hours=1), **extra,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("form", sorted(FORMS))
def test_parser_errors_quoting_a_reflected_token_are_redacted(form: str, db_url: str) -> None:
    with reflecting_receiver(FORMS[form]) as (url, requests):
        endpoint = _endpoint(url)
        with Outbox(db_url, endpoints=[endpoint]) as ob:
            ob.enqueue(endpoint="rx", method="POST", path="/x", json={"a": 1},
                       operation_id="reflected")  # fmt: skip
            ob.dispatch_once()
            op = ob.get("reflected")
            assert requests, "the receiver saw the request"
            (attempt,) = op.attempts
            assert attempt.error_message is not None
            assert "[REDACTED]" in attempt.error_message, attempt.error_message
            assert TOKEN not in attempt.error_message
            stored = _stored_bytes(ob, db_url)
    assert TOKEN.encode() not in stored


@pytest.mark.parametrize("form", sorted(FORMS))
def test_status_lookup_errors_are_redacted(form: str) -> None:
    with reflecting_receiver(FORMS[form]) as (url, requests):
        result = asyncio.run(_lookup(url))
    assert requests
    text = f"{result.error} {result.detail}"
    assert TOKEN not in text and "[REDACTED]" in text, text


def _echo_body(tok: bytes) -> bytes:
    body = b'{"status": "applied", "seen": "Bearer ' + tok + b'"}'
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def _not_found_body(tok: bytes) -> bytes:
    body = b"no such operation; you sent Bearer " + tok
    return b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


@pytest.mark.parametrize("answer", [_echo_body, _not_found_body])
def test_status_lookup_answer_echoing_the_token_is_redacted(
    answer: Callable[[bytes], bytes],
) -> None:
    with reflecting_receiver(answer) as (url, requests):
        result = asyncio.run(_lookup(url))
    assert requests
    text = f"{result.body} {result.error} {result.detail} {result.result}"
    assert TOKEN not in text and "[REDACTED]" in text, text


async def _lookup(url: str) -> LookupResult:
    endpoint = _endpoint(url, status_lookup=StatusLookup(path="/ops/{operation_id}"))
    async with build_client(endpoint, None) as client:
        return await lookup_status(client, endpoint, "op-1", "")


def test_userinfo_in_base_url_is_refused_naming_auth() -> None:
    with pytest.raises(ConfigurationError, match="auth="):
        _endpoint("http://svc:pw@127.0.0.1:9")


def _spellings(tok: bytes) -> list[bytes]:
    import base64
    import html
    import json
    from urllib.parse import quote, quote_plus

    value = "Bearer " + tok.decode()
    out = []
    for s in (value, tok.decode()):
        out += [quote(s, safe=""),
                re.sub("%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(s, safe="")),
                quote_plus(s, safe=""),
                html.escape(s), json.dumps(json.dumps(s))[3:-3],
                base64.b64encode(s.encode()).decode()]  # fmt: skip
    return [o.encode() for o in out]


def _spelled_echo(tok: bytes) -> bytes:
    body = b"echo: " + b" | ".join(_spellings(tok))
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


SPELLED = "tok/PLANTED+é&\"x<9f8e7d6c"


def test_echoed_token_in_other_spellings_is_redacted(db_url: str) -> None:
    with reflecting_receiver(_spelled_echo) as (url, requests):
        endpoint = Endpoint(
            name="rx", base_url=url, timeout=5.0,
            auth=lambda: {"Authorization": "Bearer " + quote_ascii(SPELLED)},
            retry=RetryPolicy(max_attempts=1, window=timedelta(minutes=5), wait=wait_fixed(1)),
            key_retention=timedelta(hours=1),
        )  # fmt: skip
        with Outbox(db_url, endpoints=[endpoint]) as ob:
            ob.enqueue(endpoint="rx", method="POST", path="/x", json={"a": 1},
                       operation_id="spelled")  # fmt: skip
            ob.dispatch_once()
            op = ob.get("spelled")
            assert op.result is not None
            assert "[REDACTED]" in str(op.result.body)
            stored = _stored_bytes(ob, db_url)
    assert requests
    for form in _spellings(quote_ascii(SPELLED).encode()):
        assert form not in stored, form


def quote_ascii(s: str) -> str:
    """The token as a header can carry it: ASCII only."""
    return s.replace("é", "e")
