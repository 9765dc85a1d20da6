"""pytest fixtures for testing code that uses outbox (registered through ``pytest11``).

* ``outbox_receiver``: a running :class:`outbox.testing.receiver.Receiver` on 127.0.0.1
  with its own SQLite receipts file; its ``effects()`` are the oracle.
* ``outbox_db_url``: a fresh SQLite database URL in the test's temporary directory.
* ``make_outbox``: builds an :class:`outbox.Outbox` on ``outbox_db_url`` with an endpoint
  named ``receiver`` pointing at ``outbox_receiver`` (short timeouts and window, so
  lost-response tests finish in seconds); closed after the test.

A lost-response test::

    def test_lost_response(outbox_receiver, make_outbox):
        ob = make_outbox()
        outbox_receiver.faults.drop_after_commit(times=1)
        ob.enqueue(endpoint="receiver", method="POST", path="/orders",
                   json={"sku": "X"}, operation_id="order-1")
        ob.dispatch_once()                        # response lost after the commit
        ob.clock.advance(5)                       # past the backoff (FakeClock)
        ob.dispatch_once()                        # retried, replayed
        assert ob.get("order-1").state == "succeeded"
        assert outbox_receiver.effect_count(key="order-1") == 1
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from outbox.client import Outbox
from outbox.clock import FakeClock
from outbox.config import Endpoint, RetryPolicy
from outbox.testing.receiver import Receiver


@pytest.fixture
def outbox_receiver(tmp_path: Path) -> Iterator[Receiver]:
    """A real HTTP receiver with idempotency receipts, stopped after the test."""
    with Receiver(tmp_path / "receiver.sqlite3") as receiver:
        yield receiver


@pytest.fixture
def outbox_db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'outbox.sqlite3'}"


@pytest.fixture
def make_outbox(outbox_db_url: str, outbox_receiver: Receiver) -> Iterator[Callable[..., Outbox]]:
    made: list[Outbox] = []

    def make(
        *,
        db: str | None = None,
        timeout: float = 2.0,
        max_attempts: int = 5,
        window: timedelta = timedelta(minutes=5),
        key_retention: timedelta = timedelta(hours=1),
        clock: Any = None,
        **endpoint_options: Any,
    ) -> Outbox:
        endpoint = Endpoint(
            name="receiver",
            base_url=outbox_receiver.url,
            timeout=timeout,
            retry=RetryPolicy(max_attempts=max_attempts, window=window),
            key_retention=key_retention,
            **endpoint_options,
        )
        ob = Outbox(
            db or outbox_db_url,
            endpoints=[endpoint],
            clock=clock if clock is not None else FakeClock(),
        )
        made.append(ob)
        return ob

    yield make
    for ob in made:
        ob.close()
