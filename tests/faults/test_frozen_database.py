"""A database that stops answering, and one that is down when the dispatcher starts.

A TCP proxy between the dispatcher (a subprocess) and PostgreSQL stops forwarding:
to the dispatcher, a server whose processes were frozen. SIGTERM must still end the
dispatcher within its stop timeout, non-zero, with a clear log line; its leases expire
on their own. A dispatcher started while the proxy refuses connections waits with
backoff and works once the database is back.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from outbox import State
from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from outbox.testing.receiver import Receiver
from tests.faults.pgproxy import PgProxy, pg_proxy
from tests.faults.support import dispatchers, open_outbox, until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def migrated(pg_url: str) -> str:
    engine = create_engine(pg_url)
    upgrade(engine)
    engine.dispose()
    return pg_url


@pytest.fixture
def proxy(migrated: str) -> Iterator[PgProxy]:
    with pg_proxy(migrated) as p:
        yield p


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


def test_sigterm_with_a_frozen_database_exits_within_the_stop_timeout(
    proxy: PgProxy, receiver: Receiver, tmp_path: Path
) -> None:
    with dispatchers(tmp_path) as start:
        d = start(proxy.url, receiver.url, name="frozen",
                  extra_env={"OUTBOX_TEST_STOP_TIMEOUT": "2"})  # fmt: skip
        until(lambda: d.saw("dispatcher_started"), 30, "the dispatcher to start")
        proxy.freeze()
        assert proxy.holding.wait(30), (proxy.connections, d.log.read_text()[-2000:])
        sent = time.monotonic()
        d.process.send_signal(signal.SIGTERM)
        code = d.wait(60)
        took = time.monotonic() - sent
        d.kill()
    proxy.thaw()
    assert code == 3, d.log.read_text()[-3000:]
    (event,) = [e for e in d.events() if e.get("event") == "dispatcher_stop_timed_out"]
    assert event["level"] == "error" and event["stop_timeout_seconds"] == 2.0
    assert "did not answer" in d.log.read_text()
    # Reported, not asserted (the machine may be busy): SIGTERM to exit.
    print(f"SIGTERM-to-exit with a frozen database: {took:.2f}s (stop timeout 2s)")


def test_dispatcher_started_while_the_database_is_down_waits_for_it(
    proxy: PgProxy, migrated: str, receiver: Receiver, tmp_path: Path
) -> None:
    proxy.refuse = True
    with dispatchers(tmp_path) as start:
        d = start(proxy.url, receiver.url, name="early")
        until(lambda: sum(e.get("event") == "store_unavailable" and e.get("phase") == "start"
                          for e in d.events()) >= 2, 30, "two failed starts")  # fmt: skip
        assert d.alive()
        proxy.refuse = False
        until(lambda: d.saw("dispatcher_started"), 30, "the start once the database is up")
        with open_outbox(migrated, receiver.url) as ob:
            ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                       operation_id="after-outage")  # fmt: skip
            until(lambda: ob.get("after-outage").state is State.SUCCEEDED, 30, "delivery")
        d.stop()
    assert receiver.effect_count(key="after-outage") == 1


def test_engines_we_create_carry_timeouts_keepalives_and_hide_parameters(
    migrated: str, sqlite_url: str
) -> None:
    engine = create_engine(migrated)
    try:
        assert engine.hide_parameters
        with engine.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "30s"
            info = conn.connection.driver_connection.info  # type: ignore[union-attr]
            params = info.get_parameters()
            assert params["connect_timeout"] == "10" and params["keepalives"] == "1"
    finally:
        engine.dispose()
    # Each default is overridable.
    custom = create_engine(migrated + "&connect_timeout=3", statement_timeout_ms=None,
                           connect_args={"keepalives_idle": 5})  # fmt: skip
    try:
        with custom.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "0"
            params = conn.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
            assert (params["connect_timeout"], params["keepalives_idle"]) == ("3", "5")
    finally:
        custom.dispose()
    lite = create_engine(sqlite_url)
    assert lite.hide_parameters
    lite.dispose()
