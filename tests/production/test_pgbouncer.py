"""The outbox behind a real pgbouncer: transaction and session pooling, with and without
``max_prepared_statements``. Migrations, both enqueue paths, dispatch, the operator
commands, and the wake-up: LISTEN through a direct ``listen_url``, or one warning and
the poll when LISTEN cannot work."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import DispatcherSettings, Endpoint, Outbox, State
from outbox.testing.receiver import Receiver
from tests.production.conftest import Bouncer, Place

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.production.pgb_app:outbox"


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def _outbox(url: str, rx: Receiver, **settings: object) -> Outbox:
    return Outbox(
        url,
        endpoints=[Endpoint(name="a", base_url=rx.url)],
        dispatcher=DispatcherSettings(idle_poll_seconds=300.0, **settings),  # type: ignore[arg-type]
    )


def _migrate(place: Place) -> None:
    done = cli("--db", place.pooled, "migrate")
    assert done.returncode == 0, done.stderr


def test_migrate_enqueue_dispatch_and_operator_commands(place: Place, receiver: Receiver) -> None:
    _migrate(place)
    ob = _outbox(place.pooled, receiver)
    try:
        # 30 of each: past psycopg's prepare threshold (5), on pooled server connections.
        for i in range(30):
            ob.enqueue(
                endpoint="a", method="POST", path="/o", json={"i": i}, operation_id=f"own-{i}"
            )
        with ob.engine.begin() as conn:
            for i in range(30):
                ob.enqueue(endpoint="a", method="POST", path="/o", json={"i": i},
                           operation_id=f"tx-{i}", connection=conn)
        summary = ob.run_dispatcher(until_empty=True)
        assert summary.as_dict()["succeeded"] == 60
        assert ob.get("own-7").state is State.SUCCEEDED
        assert len(receiver.requests(key="tx-29")) == 1
    finally:
        ob.close()
    status = cli("--db", place.pooled, "status", "--json")
    assert status.returncode == 0, status.stderr
    show = cli("--db", place.pooled, "show", "own-3", "--json")
    assert show.returncode == 0, show.stderr
    assert json.loads(show.stdout)["state"] == "succeeded"
    # Written in the test's own schema (the role's search_path), not in public.
    from sqlalchemy import create_engine, text

    direct = create_engine(place.direct.replace("postgresql+psycopg", "postgresql+psycopg", 1))
    with direct.connect() as conn:
        n = conn.execute(text(f'SELECT count(*) FROM "{place.schema}".outbox_operations'))
        assert n.scalar_one() == 60
    direct.dispose()


def _latency(ob: Outbox, rx: Receiver, n: int) -> tuple[list[float], object]:
    dispatcher = ob.dispatcher()
    listening = asyncio.Event()
    dispatcher.wakeup.hooks.append(
        lambda name: listening.set() if name in ("listening", "listen_unavailable") else None
    )

    async def main() -> list[float]:
        stop = asyncio.Event()
        task = asyncio.create_task(dispatcher.run(stop))
        await asyncio.wait_for(listening.wait(), 10)
        times = []
        for i in range(n):
            key = f"lat-{uuid.uuid4().hex[:8]}-{i}"
            start = time.perf_counter()
            await asyncio.to_thread(
                ob.enqueue, endpoint="a", method="POST", path="/o", json={}, operation_id=key
            )
            while not rx.requests(key=key):
                await asyncio.sleep(0.001)
            times.append(time.perf_counter() - start)
        stop.set()
        await task
        return times

    return asyncio.run(main()), dispatcher


def test_listen_url_wakes_at_once_behind_transaction_pooling(
    place: Place, receiver: Receiver
) -> None:
    if not place.pooled.endswith("_tx"):
        pytest.skip("session pooling: LISTEN works through pgbouncer")
    _migrate(place)
    ob = _outbox(place.pooled, receiver, listen_url=place.direct)
    try:
        times, dispatcher = _latency(ob, receiver, 20)
        assert dispatcher.wakeup.stats.listen_unavailable == 0  # type: ignore[attr-defined]
        assert dispatcher.wakeup.stats.polled == 0  # type: ignore[attr-defined]
        times.sort()
        p50 = times[len(times) // 2]
        print(f"enqueue->receiver p50 {p50 * 1000:.1f} ms behind pgbouncer with listen_url")
        assert p50 < 0.5  # woken by the notification, never by the 300 s poll
    finally:
        ob.close()


def test_without_listen_url_one_warning_then_poll(
    place: Place, receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    if not place.pooled.endswith("_tx"):
        pytest.skip("session pooling: LISTEN works through pgbouncer")
    _migrate(place)
    ob = Outbox(
        place.pooled,
        endpoints=[Endpoint(name="a", base_url=receiver.url)],
        dispatcher=DispatcherSettings(idle_poll_seconds=0.2, heartbeat_seconds=0.1),
    )
    try:
        with caplog.at_level(logging.WARNING, logger="outbox"):
            _times, dispatcher = _latency(ob, receiver, 3)
        warnings = [r for r in caplog.records if "listen_unavailable" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        assert "listen_url" in warnings[0].getMessage()
        assert dispatcher.wake_mode == "poll"  # type: ignore[attr-defined]
    finally:
        ob.close()
    status = cli("--db", place.pooled, "status", "--json")
    assert status.returncode == 0, status.stderr
    modes = [d["wake_mode"] for d in json.loads(status.stdout)["dispatchers"]]
    assert modes == ["poll"], status.stdout


def test_console_serves_through_pgbouncer(place: Place, receiver: Receiver) -> None:
    pytest.importorskip("starlette")
    import httpx

    from tests.acceptance._console_proc import console_process

    _migrate(place)
    ob = _outbox(place.pooled, receiver)
    try:
        ob.enqueue(endpoint="a", method="POST", path="/o", json={}, operation_id="seen-in-console")
    finally:
        ob.close()
    with console_process("--db", place.pooled) as console:
        token = console.token()
        with httpx.Client(base_url=console.url, follow_redirects=True) as http:
            r = http.post("/login", data={"token": token, "next": "/queue"})
            assert r.status_code == 200, r.text[:300]
            page = http.get("/operation?tenant=&id=seen-in-console")
            assert page.status_code == 200 and "seen-in-console" in page.text


def test_schema_option_refused_by_pgbouncer_names_the_fix(
    bouncers: dict[str, Bouncer], place: Place
) -> None:
    if not place.pooled.endswith("_tx"):
        pytest.skip("one pooling mode is enough: the refusal is at connect")
    strict = bouncers["strict"]
    name = place.pooled.rsplit("/", 1)[1]
    strict.add(name, place.schema, "transaction")
    done = cli("--db", strict.url(name, place.schema), "--schema", place.schema, "migrate")
    assert done.returncode == 3, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "ALTER ROLE" in line and "search_path" in line, line
    from sqlalchemy import create_engine, text

    direct = create_engine(place.direct)
    with direct.connect() as conn:
        tables = conn.execute(
            text("SELECT count(*) FROM pg_tables WHERE schemaname = :s"), {"s": place.schema}
        ).scalar_one()
    direct.dispose()
    assert tables == 0  # nothing was written
