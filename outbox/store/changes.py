"""Change signals: how an idle dispatcher learns that work may be due, without a claim.

* PostgreSQL: ``enqueue``'s INSERT calls ``pg_notify`` in the caller's transaction, so
  the notification leaves only at commit (a rolled-back enqueue sends nothing). Its
  payload is the endpoint name, never arguments. :class:`PostgresListener` holds one
  dedicated connection that ``LISTEN``\\s and re-establishes it with backoff when it
  drops, waking the dispatcher after every (re)connect: notifications sent while it was
  away are lost, the claim that follows finds their rows.
* SQLite: :func:`announce` wakes dispatchers of the same database file in this process
  (a registry keyed by the file's real path) after an enqueue commits;
  :class:`SqliteWatch` also reads ``PRAGMA data_version`` on an open connection every
  few milliseconds, which changes whenever another connection (another process, too)
  commits: a check of a few microseconds instead of a claim query.

A signal only ever causes a claim; the claim decides what is due. A lost or spurious
signal costs latency or one empty claim, never correctness.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, func, literal
from sqlalchemy.sql.elements import ColumnElement


def _logger() -> Any:
    # Imported when a listener logs, not with the store: reading an outbox (the operator's
    # commands) never loads structlog (tests/acceptance/test_cli_startup.py). The library's
    # own logger (stdlib logging under "outbox"), never structlog's global one.
    from outbox.base.logs import get_logger

    return get_logger("outbox.wakeup")


#: Called with the reason: "listening" (after each (re)connect), "notified", "changed",
#: "local". Runs on the dispatcher's event loop.
Wake = Callable[[str], None]
#: Reports what the source did ("listening", "listener_lost", ...); for logs and tests.
Report = Callable[[str], None]

#: The longest wait before a lost listener connection is tried again.
MAX_RECONNECT_SECONDS = 5.0


class ChangeSource(Protocol):
    """Runs until cancelled, calling ``wake`` whenever work may have become due."""

    async def run(self, wake: Wake, report: Report) -> None: ...


# --------------------------------------------------------------------------- PostgreSQL


class ChangeSignals:
    """The hooks a store overrides to signal dispatchers of its database (the base of
    :class:`~outbox.store.base.Store`; the defaults signal nothing: poll only)."""

    def _insert_wakes(self) -> tuple[Any, ...]:
        """Extra RETURNING columns of the enqueue INSERT that signal dispatchers."""
        return ()

    def _signal_on(self, conn: Connection) -> None:
        """Signal dispatchers from inside ``conn``'s transaction (delivered at commit)."""

    def announce(self) -> None:
        """Tell this process's dispatchers that a transaction of ours just committed work."""

    def change_source(
        self, *, application_name: str, interval: float, listen_url: str | None = None
    ) -> ChangeSource | None:
        """What wakes an idle dispatcher of this database, or None: poll only."""
        return None


def notify_channel() -> ColumnElement[Any]:
    """The channel, per schema: dispatchers of other schemas on the server are not woken.

    Evaluated by the server in the writer's session, so it costs no round trip.
    """
    return func.left(literal("outbox_") + func.current_schema(), 63)


def notify_column(endpoint: ColumnElement[Any]) -> ColumnElement[Any]:
    """``pg_notify(channel, endpoint)``: added to the INSERT's RETURNING, it runs once per
    inserted row inside the caller's transaction (PostgreSQL folds identical
    notifications of one transaction into one)."""
    return func.pg_notify(notify_channel(), endpoint)


class PostgresListener:
    """One dedicated psycopg connection that LISTENs on the outbox's channel.

    ``listen_url``: connect there for LISTEN (a direct server connection, when the
    store's URL goes through pgbouncer in transaction pooling). At the first connect the
    listener checks that LISTEN works: a notification sent through the store's own URL
    (the writers' path) must arrive within :data:`PROBE_SECONDS`. If it does not, it
    logs one ``listen_unavailable`` warning naming ``listen_url``, reports
    "listen_unavailable" and ends: the dispatcher polls.
    """

    def __init__(
        self, engine: Engine, *, application_name: str, listen_url: str | None = None
    ) -> None:
        self._kwargs = _connect_kwargs(engine, None, application_name)
        self._listen_kwargs = _connect_kwargs(engine, listen_url, application_name)
        self.listen_url = listen_url
        self.application_name = self._kwargs["application_name"]
        #: The server process of the current listening connection (None between them).
        self.backend_pid: int | None = None
        self._probed = False

    async def _connect(self) -> Any:
        import psycopg
        from psycopg import sql

        # The channel as the writers compute it, in a session like theirs.
        writer = await psycopg.AsyncConnection.connect(autocommit=True, **self._kwargs)
        try:
            cur = await writer.execute(_CHANNEL_SQL)
            row = await cur.fetchone()
            channel = str(row[0]) if row else "outbox_"
            conn = await psycopg.AsyncConnection.connect(autocommit=True, **self._listen_kwargs)
            try:
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                if not self._probed:
                    if not await _probe(conn, writer, channel):
                        await conn.close()
                        return None
                    self._probed = True
            except BaseException:
                await conn.close()
                raise
        finally:
            await _close_quietly(writer)
        return conn

    async def run(self, wake: Wake, report: Report) -> None:
        import psycopg

        backoff = 0.0
        while True:
            conn = None
            try:
                conn = await self._connect()
                if conn is None:
                    _logger().warning(
                        "listen_unavailable",
                        detail=(
                            "a NOTIFY sent through the database URL did not reach the "
                            f"listening connection within {PROBE_SECONDS:g} s (pgbouncer "
                            "in transaction pooling?); set listen_url (outbox dispatch "
                            "--listen-url, OUTBOX_LISTEN_URL) to a direct connection. "
                            "Polling instead."
                        ),
                        listen_url_set=self.listen_url is not None,
                    )
                    report("listen_unavailable")
                    return
                self.backend_pid = conn.info.backend_pid
                backoff = 0.0
                wake("listening")  # notifications sent while we were away are lost
                async for _note in conn.notifies():
                    wake("notified")
                # notifies() ends only when the connection does.
                raise psycopg.OperationalError("the listening connection closed")
            except psycopg.Error as exc:
                self.backend_pid = None
                backoff = min(backoff * 2 if backoff else 0.1, MAX_RECONNECT_SECONDS)
                _logger().warning(
                    "listener_lost",
                    error=type(exc).__name__,
                    detail=str(exc).splitlines()[0][:200] if str(exc) else "",
                    retry_in_seconds=backoff,
                )
                report("listener_lost")
            finally:
                if conn is not None:
                    await _close_quietly(conn)
            await asyncio.sleep(backoff)


#: How long the start-up check waits for its own notification.
PROBE_SECONDS = 1.0


def _connect_kwargs(engine: Engine, url: str | None, application_name: str) -> dict[str, Any]:
    from sqlalchemy.engine import make_url

    target = engine.url if url is None else make_url(url)
    _args, kwargs = engine.dialect.create_connect_args(target)
    kwargs.pop("context", None)
    if url is not None:
        # The store's connect options (timeouts, keepalives; the schema's search_path)
        # unless the listen URL names its own.
        _a, base = engine.dialect.create_connect_args(engine.url)
        for key in ("connect_timeout", "keepalives", "keepalives_idle", "options"):
            if key in base and key not in kwargs:
                kwargs[key] = base[key]
    kwargs["application_name"] = application_name[:63]
    return dict(kwargs)


async def _probe(conn: Any, writer: Any, channel: str) -> bool:
    """Whether a notification the writer sends reaches ``conn`` within the probe time."""
    await writer.execute("SELECT pg_notify(%s, '')", (channel,))
    gen = conn.notifies(timeout=PROBE_SECONDS, stop_after=1)
    async for _note in gen:
        return True
    return False


_CHANNEL_SQL = "SELECT left('outbox_' || current_schema(), 63)"


async def _close_quietly(conn: Any) -> None:
    try:
        await conn.close()
    except Exception as exc:  # a dead connection may complain on close
        _logger().debug("listener_close_failed", error=type(exc).__name__)


# --------------------------------------------------------------------------- SQLite

_local_lock = threading.Lock()
_local: dict[str, set[tuple[asyncio.AbstractEventLoop, Wake]]] = {}


def local_key(path: Path) -> str:
    """The registry's key for a SQLite file: its real path."""
    return str(path.resolve())


def announce(key: str | None) -> None:
    """Wake this process's dispatchers of the SQLite file ``key`` (after a commit)."""
    if key is None or not _local:
        return
    with _local_lock:
        targets = list(_local.get(key, ()))
    for loop, wake in targets:
        try:
            loop.call_soon_threadsafe(wake, "local")
        except RuntimeError:  # that loop has closed; its dispatcher is gone
            continue


class SqliteWatch:
    """In-process wake-ups plus a ``PRAGMA data_version`` check every ``interval``."""

    def __init__(self, path: Path, *, interval: float) -> None:
        self.path = path
        self.interval = interval

    async def run(self, wake: Wake, report: Report) -> None:
        loop = asyncio.get_running_loop()
        entry = (loop, wake)
        key = local_key(self.path)
        with _local_lock:
            _local.setdefault(key, set()).add(entry)
        # timeout=0: the check must never sleep in SQLite's busy handler on the loop.
        # mode=rw: never create the file (the dispatcher's preflight checked it exists
        # and is private).
        conn = sqlite3.connect(
            f"{self.path.resolve().as_uri()}?mode=rw",
            uri=True,
            timeout=0,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            last = _data_version(conn)
            report("listening")
            while True:
                await asyncio.sleep(self.interval)
                current = _data_version(conn)
                if current != last:
                    last = current
                    wake("changed")
        finally:
            conn.close()
            with _local_lock:
                entries = _local.get(key)
                if entries is not None:
                    entries.discard(entry)
                    if not entries:
                        del _local[key]


def _data_version(conn: sqlite3.Connection) -> int | None:
    """Changes whenever another connection commits to the file. None if unreadable
    right now (busy): then it differs from the last value and the claim decides."""
    try:
        row = conn.execute("PRAGMA data_version").fetchone()
    except sqlite3.Error:
        return None
    return int(row[0]) if row else None
