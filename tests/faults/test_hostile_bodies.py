"""Hostile response bodies cost neither memory nor time: bombs, huge and endless bodies.

A real receiver over TCP (``tests.faults.hostile``) answers 200 with a gzip bomb, a
``gzip, gzip`` bomb of a few hundred bytes, 70 MB in full, an endless chunked body, a
one-byte drip, corrupt gzip. The dispatcher reads each through one bounded reader:
decoded incrementally, hashed as it streams, stopped at the endpoint's ``read_limit``
and recorded as *at least* that big (no hash that would describe only a prefix).
Memory and wall time under 32 concurrent hostile responses are a benchmark figure
(``benchmarks/hostile.py``), not asserted here.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from tenacity import wait_fixed

from outbox import Delivery, DispatcherSettings, Endpoint, Outbox, RetryPolicy, State
from outbox.config import StatusLookup
from outbox.model import LookupStatus
from outbox.wire.lookup import lookup_status
from outbox.wire.transport import build_client
from tests.faults.hostile import hostile_receiver

LIMIT = 1024 * 1024
PATHS = ["/bomb", "/bomb2", "/huge", "/endless", "/gzip-json", "/corrupt", "/drip"]


@pytest.fixture
def hostile() -> Iterator[tuple[str, object]]:
    with hostile_receiver() as pair:
        yield pair


def _endpoint(url: str, **kw: object) -> Endpoint:
    return Endpoint(name="hostile", base_url=url, timeout=2.0, read_limit=LIMIT,
                    retry=RetryPolicy(max_attempts=1, window=timedelta(minutes=5),
                                      wait=wait_fixed(1)),
                    key_retention=timedelta(hours=1), **kw)  # type: ignore[arg-type]  # fmt: skip


def test_every_hostile_body_is_bounded_and_recorded_honestly(
    hostile: tuple[str, object], tmp_path: Path
) -> None:
    url, _ = hostile
    with Outbox(f"sqlite:///{tmp_path / 'ob.sqlite3'}", endpoints=[_endpoint(url)],
                dispatcher=DispatcherSettings(concurrency=8)) as ob:  # fmt: skip
        for path in PATHS:
            ob.enqueue(endpoint="hostile", method="POST", path=path, json={},
                       operation_id=path.strip("/"))  # fmt: skip
        summary = ob.dispatch_once()
        assert summary.attempts == len(PATHS)
        ops = {path: ob.get(path.strip("/")) for path in PATHS}

    for path in ("/bomb", "/bomb2", "/huge", "/endless"):
        op = ops[path]
        assert op.state is State.SUCCEEDED, (path, op.attempts)
        assert op.result is not None
        # Over the limit: recorded as "at least", never as a complete size and hash.
        assert op.result.body_sha256 is None, path
        assert op.result.truncated
        assert op.result.body_size == LIMIT + 1, path
        assert op.result.body is None  # over the result limit: not kept (one shape)

    ok = ops["/gzip-json"]
    assert ok.state is State.SUCCEEDED and ok.result is not None
    assert ok.result.body == {"ok": True, "n": 1}
    raw = b'{"ok": true, "n": 1}'
    assert ok.result.body_sha256 == hashlib.sha256(raw).hexdigest()
    assert (ok.result.body_size, ok.result.truncated) == (len(raw), False)

    (corrupt,) = ops["/corrupt"].attempts
    assert (corrupt.error_class, corrupt.delivery) == ("DecodingError", Delivery.UNKNOWN)

    (drip,) = ops["/drip"].attempts
    assert (drip.error_class, drip.delivery) == ("AttemptDeadlineExceeded", Delivery.UNKNOWN)


def test_status_lookup_answers_are_read_through_the_same_bound(
    hostile: tuple[str, object],
) -> None:
    url, _ = hostile

    async def ask(path: str) -> object:
        endpoint = _endpoint(url, status_lookup=StatusLookup(path=path + "?op={operation_id}"))
        client = build_client(endpoint, None)
        try:
            return await lookup_status(client, endpoint, "op-1", "")
        finally:
            await client.aclose()

    for path in ("/bomb", "/bomb2", "/endless"):
        result = asyncio.run(ask(path))
        assert result.status is LookupStatus.UNKNOWN, path  # type: ignore[attr-defined]
        assert "exceeds" in result.detail, path  # type: ignore[attr-defined]
