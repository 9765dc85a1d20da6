"""Wake on enqueue: PostgreSQL LISTEN/NOTIFY, SQLite in-process and data_version signals.

Every dispatcher here polls every 300 s, so an operation sent within the test was sent
because of a signal or a known due time; the wake-up counters (``dispatcher.wakeup``)
say which, and the receiver's own store says what was sent. No assertion is on timing.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from outbox import DispatcherSettings, Endpoint, Intent, Outbox, RetryPolicy, State
from outbox.dispatch import failpoints
from outbox.dispatch.dispatcher import Dispatcher
from outbox.testing.receiver import Receiver
from tests.conftest import POSTGRES_URL

POLL = 300.0  # the safety-net poll never fires within a test
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def pg_db(pg_url: str) -> str:
    from outbox.store.engine import create_engine as outbox_engine
    from outbox.store.migrate import upgrade

    engine = outbox_engine(pg_url)
    upgrade(engine)
    engine.dispose()
    return pg_url


def _outbox(url: str, rx: Receiver) -> Outbox:
    from datetime import timedelta

    from tenacity import wait_fixed

    retry = RetryPolicy(max_attempts=5, window=timedelta(minutes=5), wait=wait_fixed(0.3))
    return Outbox(
        url,
        endpoints=[
            Endpoint(name="a", base_url=rx.url, retry=retry),
            Endpoint(name="b", base_url=rx.url, retry=retry),
        ],
    )


def _dispatcher(ob: Outbox, **settings: Any) -> Dispatcher:
    settings.setdefault("dispatcher_id", f"t-{uuid.uuid4().hex[:12]}")
    return ob.dispatcher(DispatcherSettings(idle_poll_seconds=POLL, **settings))


class Events:
    """Wake-up events of one dispatcher, awaitable by name and count."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.seen: list[str] = []
        self._changed = asyncio.Event()
        self.on: dict[str, Callable[[], None]] = {}
        dispatcher.wakeup.hooks.append(self._hook)

    def _hook(self, name: str) -> None:
        self.seen.append(name)
        self._changed.set()
        action = self.on.get(name)
        if action is not None:
            action()

    def count(self, name: str) -> int:
        return self.seen.count(name)

    async def reach(self, name: str, n: int = 1) -> None:
        while self.count(name) < n:
            self._changed.clear()
            await self._changed.wait()


async def _settled(ob: Outbox, ids: list[str]) -> None:
    while True:
        states = [await asyncio.to_thread(ob.store.get_state, "", i) for i in ids]
        if all(s is not None and s.is_settled for s in states):
            return
        await asyncio.sleep(0.02)


def _run(coro: Any, timeout: float = 60.0) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


def _enqueue(ob: Outbox, op_id: str, endpoint: str = "a") -> None:
    ob.enqueue(endpoint=endpoint, method="POST", path="/orders", json={"id": op_id},
               operation_id=op_id)


# --------------------------------------------------------------------------- PostgreSQL


def test_rolled_back_enqueue_notifies_nobody_and_sends_nothing(
    pg_db: str, receiver: Receiver
) -> None:
    ob = _outbox(pg_db, receiver)
    dispatcher = _dispatcher(ob)
    events = Events(dispatcher)

    def rolled_back() -> None:
        with ob.engine.connect() as conn:
            tx = conn.begin()
            _enqueue_on(ob, conn, "rolled-back", "a")
            tx.rollback()

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(dispatcher.run(stop))
        await events.reach("listening")
        await asyncio.to_thread(rolled_back)
        # Notifications arrive in commit order: had the rolled-back one been sent, it
        # would be counted before this committed one's operation could be claimed.
        await asyncio.to_thread(_enqueue, ob, "committed", "b")
        await _settled(ob, ["committed"])
        stop.set()
        await task

    try:
        _run(main())
        assert events.count("notified") == 1
        assert dispatcher.wakeup.stats.polled == 0
        assert ob.store.get_state("", "rolled-back") is None
        assert receiver.requests(key="rolled-back") == []
        assert ob.get("committed").state is State.SUCCEEDED
    finally:
        ob.close()


def _enqueue_on(ob: Outbox, conn: Any, op_id: str, endpoint: str) -> None:
    ob.enqueue(endpoint=endpoint, method="POST", path="/orders", json={"id": op_id},
               operation_id=op_id, connection=conn)


def test_killed_listener_is_reestablished_and_nothing_is_lost(
    pg_db: str, receiver: Receiver
) -> None:
    ob = _outbox(pg_db, receiver)
    dispatcher = _dispatcher(ob)
    events = Events(dispatcher)
    listener = dispatcher.wakeup.source
    admin = create_engine(POSTGRES_URL)
    # While the listener is down (inside the dispatcher, before it reconnects): this
    # enqueue's notification reaches nobody; the claim after reconnecting must find it.
    events.on["listener_lost"] = lambda: _enqueue(ob, "while-down")

    def kill_listener() -> int:
        with admin.begin() as conn:
            return len(
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE pid = :pid AND application_name = :name"
                    ),
                    {"pid": listener.backend_pid, "name": listener.application_name},  # type: ignore[union-attr]
                ).all()
            )

    async def main() -> int:
        stop = asyncio.Event()
        task = asyncio.create_task(dispatcher.run(stop))
        await events.reach("listening")
        await asyncio.to_thread(_enqueue, ob, "before")
        await _settled(ob, ["before"])
        killed = await asyncio.to_thread(kill_listener)
        await events.reach("listening", 2)
        await _settled(ob, ["while-down"])
        await asyncio.to_thread(_enqueue, ob, "after")
        await _settled(ob, ["after"])
        stop.set()
        await task
        return killed

    try:
        assert _run(main()) == 1
        stats = dispatcher.wakeup.stats
        assert stats.listener_lost == 1 and stats.listening == 2
        assert stats.polled == 0
        for op_id in ("before", "while-down", "after"):
            assert ob.get(op_id).state is State.SUCCEEDED, op_id
            assert len(receiver.requests(key=op_id)) == 1, op_id
    finally:
        ob.close()
        admin.dispose()


def test_two_notified_dispatchers_claim_disjoint_rows(pg_db: str, receiver: Receiver) -> None:
    n = 40
    ob = _outbox(pg_db, receiver)
    first, second = _dispatcher(ob, batch_size=5), _dispatcher(ob, batch_size=5)
    events = [Events(first), Events(second)]
    claimers = 0
    both_claimed = asyncio.Event()

    async def barrier(_name: str) -> None:
        # Hold each dispatcher after its first claim until the other has claimed too:
        # both take part, each from its own notification.
        nonlocal claimers
        claimers += 1
        if claimers >= 2:
            both_claimed.set()
        await both_claimed.wait()

    async def main() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(d.run(stop)) for d in (first, second)]
        for e in events:
            await e.reach("listening")
        await asyncio.to_thread(
            ob.enqueue_many,
            [Intent("a", "POST", "/orders", {"i": i}, operation_id=f"op-{i}") for i in range(n)],
        )
        await _settled(ob, [f"op-{i}" for i in range(n)])
        stop.set()
        await asyncio.gather(*tasks)

    failpoints.register("after_claim", barrier)
    try:
        _run(main())
    finally:
        failpoints.clear("after_claim")
    try:
        assert all(e.count("notified") >= 1 for e in events)
        assert first.summary.claimed > 0 and second.summary.claimed > 0
        assert first.summary.claimed + second.summary.claimed == n
        assert first.wakeup.stats.polled == second.wakeup.stats.polled == 0
        ids = {first.dispatcher_id, second.dispatcher_id}
        for i in range(n):
            op = ob.get(f"op-{i}")
            assert op.state is State.SUCCEEDED
            assert len(op.attempts) == 1 and op.attempts[0].dispatcher_id in ids
        requests = receiver.requests()
        assert len(requests) == n and len({r.key for r in requests}) == n
    finally:
        ob.close()


# --------------------------------------------------------------------------- both


def test_retry_is_claimed_at_its_due_time_not_at_the_poll(
    db_url: str, receiver: Receiver
) -> None:
    ob = _outbox(db_url, receiver)
    dispatcher = _dispatcher(ob)
    events = Events(dispatcher)
    receiver.faults.fail_before_work(503, retry_after=None, times=1, key="retried")

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(dispatcher.run(stop))
        await events.reach("listening")
        await asyncio.to_thread(_enqueue, ob, "retried")
        await _settled(ob, ["retried"])
        stop.set()
        await task

    try:
        _run(main())
        op = ob.get("retried")
        assert op.state is State.SUCCEEDED
        assert [a.status_code for a in op.attempts] == [503, 201]
        assert dispatcher.wakeup.stats.due >= 1  # woken for the retry's next_attempt_at
        assert dispatcher.wakeup.stats.polled == 0
    finally:
        ob.close()


def test_next_due_is_the_earliest_future_due_time(db_url: str, receiver: Receiver) -> None:
    ob = _outbox(db_url, receiver)
    try:
        now = ob.clock.now_ms()
        assert ob.store.next_due_ms(now) is None
        _enqueue(ob, "due-now")  # due already: not a future due time
        assert ob.store.next_due_ms(ob.clock.now_ms()) is None
        assert ob.store.next_due_ms(now - 60_000) is not None
    finally:
        ob.close()


# --------------------------------------------------------------------------- SQLite


def test_sqlite_enqueue_in_the_same_process_wakes_the_dispatcher(
    sqlite_url: str, receiver: Receiver
) -> None:
    ob = _outbox(sqlite_url, receiver)
    dispatcher = _dispatcher(ob, change_check_seconds=POLL)  # the in-process signal alone
    events = Events(dispatcher)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(dispatcher.run(stop))
        await events.reach("listening")
        await asyncio.to_thread(_enqueue, ob, "local")
        await _settled(ob, ["local"])
        stop.set()
        await task

    try:
        _run(main())
        stats = dispatcher.wakeup.stats
        assert ob.get("local").state is State.SUCCEEDED
        assert stats.local >= 1 and stats.changed == 0 and stats.polled == 0
    finally:
        ob.close()


def test_sqlite_enqueue_from_another_process_wakes_the_dispatcher(
    sqlite_url: str, receiver: Receiver
) -> None:
    ob = _outbox(sqlite_url, receiver)
    dispatcher = _dispatcher(ob)
    events = Events(dispatcher)
    script = (
        "import sys; from outbox import Outbox, Endpoint\n"
        "ob = Outbox(sys.argv[1], endpoints=[Endpoint(name='a', base_url=sys.argv[2])])\n"
        "ob.enqueue(endpoint='a', method='POST', path='/orders', json={}, "
        "operation_id='remote')\n"
        "ob.close()\n"
    )

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(dispatcher.run(stop))
        await events.reach("listening")
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", script, sqlite_url, receiver.url],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )
        assert proc.returncode == 0, proc.stderr
        await _settled(ob, ["remote"])
        stop.set()
        await task

    try:
        _run(main())
        stats = dispatcher.wakeup.stats
        assert ob.get("remote").state is State.SUCCEEDED
        assert stats.changed >= 1 and stats.local == 0 and stats.polled == 0
    finally:
        ob.close()


def test_poll_only_dispatcher_runs_no_signal_source(sqlite_url: str, receiver: Receiver) -> None:
    ob = _outbox(sqlite_url, receiver)
    try:
        dispatcher = ob.dispatcher(DispatcherSettings(wake_on_change=False, idle_poll_seconds=0.05))
        assert dispatcher.wakeup.source is None
        _enqueue(ob, "polled")

        async def main() -> None:
            stop = asyncio.Event()
            task = asyncio.create_task(dispatcher.run(stop))
            await _settled(ob, ["polled"])
            stop.set()
            await task

        _run(main())
        assert ob.get("polled").state is State.SUCCEEDED
        assert dispatcher.wakeup.stats.local == dispatcher.wakeup.stats.changed == 0
    finally:
        ob.close()
