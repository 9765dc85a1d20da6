"""pytest fixtures for testing code that uses outbox (registered through ``pytest11``).

* ``outbox_receiver``: a running :class:`outbox.testing.receiver.Receiver` on 127.0.0.1
  with its own SQLite receipts file; its ``effects()`` are the oracle.
* ``outbox_db_url``: a fresh SQLite database URL in the test's temporary directory.
* ``make_outbox``: builds an :class:`outbox.Outbox` on ``outbox_db_url`` with an endpoint
  named ``receiver`` pointing at ``outbox_receiver`` (short timeouts and window, so
  lost-response tests finish in seconds) and a :class:`outbox.FakeClock`; every outbox it
  made is closed after the test. Its keywords: ``db`` (another database URL or Engine),
  ``name`` and ``base_url`` of the endpoint, ``timeout``, ``max_attempts``, ``window``,
  ``wait`` (a tenacity wait strategy, e.g. ``wait_fixed(1)`` for a predictable backoff),
  ``key_retention``, ``clock``, and any other :class:`outbox.Endpoint` option
  (``tenant_header="X-Tenant"``, ``auth=...``).

To give the receiver your own effect (``handler``) or options, override the fixture in
your ``conftest.py``; ``make_outbox`` then points at yours::

    @pytest.fixture
    def outbox_receiver(tmp_path):
        with Receiver(tmp_path / "receiver.sqlite3", handler=my_handler) as rx:
            yield rx

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
from sqlalchemy import Engine

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
        db: str | Engine | None = None,
        name: str = "receiver",
        base_url: str | None = None,
        timeout: float = 2.0,
        max_attempts: int = 5,
        window: timedelta = timedelta(minutes=5),
        wait: Any = None,
        key_retention: timedelta = timedelta(hours=1),
        clock: Any = None,
        **endpoint_options: Any,
    ) -> Outbox:
        retry = (
            RetryPolicy(max_attempts=max_attempts, window=window)
            if wait is None
            else RetryPolicy(max_attempts=max_attempts, window=window, wait=wait)
        )
        endpoint = Endpoint(
            name=name,
            base_url=base_url or outbox_receiver.url,
            timeout=timeout,
            retry=retry,
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
